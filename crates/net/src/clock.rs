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
//!
//! A busy host starves threads one by one rather than the process whole: the watcher wakes on
//! time while the pollers that carry a unit's data and its heartbeats wait for a core for
//! seconds (16 readout units × 60 builders in one process beside four busy loops: 3 588 events
//! built incomplete, each waiting past its timeout for a unit whose super-fragments sat in the
//! unit's own send queue). So the data path's threads are watched too ([`watch_this_thread`]):
//! every [`STARVE_LOOK`] the watcher reads how long each waited for a core (Linux schedstat,
//! `run_delay`), and the most any of them waited, beyond a tenth of the interval and what the
//! gaps already left out, is left out as well.

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
/// How often the watcher reads how long the watched threads waited for a core.
pub const STARVE_LOOK: Duration = Duration::from_millis(50);

/// A data-path thread whose waits for a core count as time the process did not run.
struct Watched {
    tid: i32,
    /// Its `run_delay` at the last look, ns.
    waited: u64,
}

fn watched() -> &'static Mutex<Vec<Watched>> {
    static W: OnceLock<Mutex<Vec<Watched>>> = OnceLock::new();
    W.get_or_init(Mutex::default)
}

/// How long thread `tid` of this process has waited for a core (ns), from
/// `/proc/self/task/<tid>/schedstat`; `None` where the kernel does not keep it.
fn run_delay(tid: i32) -> Option<u64> {
    let t = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
    t.split_whitespace().nth(1)?.parse().ok()
}

/// Watches the calling thread until the guard drops: its waits for a core are left out of
/// runnable time like stalls of the whole process. For the threads that carry data and
/// heartbeats between roles (pollers, emulated sources).
pub fn watch_this_thread() -> WatchGuard {
    // SAFETY: gettid has no preconditions and cannot fail.
    let tid = unsafe { libc::gettid() };
    clock();
    if let Some(waited) = run_delay(tid) {
        watched().lock().push(Watched { tid, waited });
    }
    WatchGuard { tid }
}

/// Ends [`watch_this_thread`] (a thread id may be given to another thread after this one ends).
pub struct WatchGuard {
    tid: i32,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        watched().lock().retain(|w| w.tid != self.tid);
    }
}

/// How much of `interval` (ns) to leave out when the most starved watched thread waited
/// `worst` ns for a core and stalls already left out `stalled` ns of it: what exceeds a tenth of
/// the interval (a core shared fairly costs that much without anyone being late) and the
/// stalls, at most the interval.
fn starvation(worst: u64, interval: u64, stalled: u64) -> u64 {
    worst
        .saturating_sub(interval / 10)
        .saturating_sub(stalled)
        .min(interval.saturating_sub(stalled))
}

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
            .spawn(move || {
                let mut starve_look = (c.wall_ns(Instant::now()), 0u64);
                loop {
                    std::thread::sleep(TICK);
                    let now = c.wall_ns(Instant::now());
                    c.look(now);
                    if now.saturating_sub(starve_look.0) >= STARVE_LOOK.as_nanos() as u64 {
                        starve_look = c.look_at_starvation(starve_look, now);
                    }
                }
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

    /// Leaves out how long the watched threads starved since the last look (`(wall ns,
    /// stalled ns)` then); the look now.
    fn look_at_starvation(&self, (then, stalled_then): (u64, u64), now: u64) -> (u64, u64) {
        let mut worst = 0;
        for w in watched().lock().iter_mut() {
            if let Some(waited) = run_delay(w.tid) {
                worst = worst.max(waited.saturating_sub(w.waited));
                w.waited = waited;
            }
        }
        let stalled = self.stalled.load(Ordering::Acquire);
        let left_out = starvation(worst, now - then, stalled - stalled_then);
        if left_out > 0 {
            self.leave_out(now, left_out);
        }
        (now, self.stalled.load(Ordering::Acquire))
    }

    /// Leaves out `ns` ending at wall ns `now`, after every stall already left out (stalls
    /// stay in order and never overlap).
    fn leave_out(&self, now: u64, ns: u64) {
        let mut s = self.stalls.lock();
        let after = s.recent.back().map_or(0, |&(_, b)| b);
        let start = now.saturating_sub(ns).max(after);
        if start >= now {
            return;
        }
        if s.recent.len() == REMEMBERED {
            if let Some((a, b)) = s.recent.pop_front() {
                s.forgotten_ns += b - a;
            }
        }
        s.recent.push_back((start, now));
        self.stalled.fetch_add(now - start, Ordering::AcqRel);
        self.last.fetch_max(now, Ordering::AcqRel);
    }

    /// Runnable ns at wall ns `t` (stalls up to then left out; inside one, its start). Walks
    /// back from the newest stall: `t` is most often a read's start a moment ago, so this
    /// looks at the few stalls since, not at all that are remembered.
    fn runnable_at(&self, t: u64) -> u64 {
        let s = self.stalls.lock();
        // Every stall is added to `stalled` under this lock: it is their sum.
        let mut left_out = self.stalled.load(Ordering::Acquire);
        for &(a, b) in s.recent.iter().rev() {
            if b <= t {
                break;
            }
            left_out -= b - a.max(t);
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
        // A watched thread starved 40 of the next 50 ms: 35 ms of it left out (the first
        // tenth is a fair share), after the stall, and readings inside it stop at its start.
        let before = c.stalled.load(Ordering::Relaxed);
        c.leave_out(3_050 * ms, starvation(40 * ms, 50 * ms, 0));
        assert_eq!(c.stalled.load(Ordering::Relaxed) - before, 35 * ms);
        assert_eq!(c.runnable_at(3_020 * ms), c.runnable_at(3_015 * ms));
        assert!(c.runnable_at(3_050 * ms) > c.runnable_at(3_000 * ms));
    }

    #[test]
    fn starvation_counts_beyond_a_fair_share_and_not_twice() {
        let ms = 1_000_000u64;
        assert_eq!(starvation(4 * ms, 50 * ms, 0), 0);
        assert_eq!(starvation(45 * ms, 50 * ms, 0), 40 * ms);
        // A gap already left out 30 ms of the same wait.
        assert_eq!(starvation(45 * ms, 50 * ms, 30 * ms), 10 * ms);
        // Never more than the interval.
        assert_eq!(starvation(500 * ms, 50 * ms, 0), 50 * ms);
        assert_eq!(starvation(500 * ms, 50 * ms, 20 * ms), 30 * ms);
    }

    #[test]
    fn a_watched_thread_reads_its_own_wait_for_a_core() {
        let g = watch_this_thread();
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        if run_delay(tid).is_some() {
            assert!(watched().lock().iter().any(|w| w.tid == tid));
        }
        drop(g);
        assert!(!watched().lock().iter().any(|w| w.tid == tid));
    }
}

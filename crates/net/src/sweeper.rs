//! One thread per stage that runs every role's periodic sweep (event timeouts, silence of links
//! that never connected), instead of a sleeping thread per role.
//!
//! Why: a 16 x 60 trapezoid in one process had 76 sweep threads, each waking every 5 ms to find
//! nothing to do most of the time: 15 000 wake-ups a second, 11 % of all CPU samples of the run
//! (`perf`, docs/PERFORMANCE.md), where 8 x 2 spent 1.5 %. One thread per stage wakes 200 times a
//! second whatever the number of roles, and the thread count stops growing with them.
//!
//! A sweep may wait on the next stage (a readout unit handing a timed-out event to a full
//! builder queue), so, as with the pollers ([`crate::reactor::Reactor::stage`]), each stage has
//! its own sweeper: waits only point downstream, and a sweeper never waits on itself.

use crate::reactor::{Stage, Tally, TallyGuard};
use crossbeam_channel::{unbounded, Receiver, Sender};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// How often each sweep runs at least: the resolution of event timeouts. With a longer
/// moderation the sweeps run on its grid instead, with the links' timed looks: at low rates a
/// slow link's fragments come at those points anyway, and each wake-up of a sweeper costs
/// about 25 us here, 400 a second for two stages (about 4 % of the DAQ's CPU at 1 kHz:
/// docs/PERFORMANCE.md). The configuration keeps the moderation within a quarter of every
/// event timeout.
pub const SWEEP_PERIOD: Duration = Duration::from_millis(5);

/// When the sweeps after a round that was due at `due` run next, under the moderation `m`.
fn next_round(due: Instant, now: Instant, m: Duration) -> Instant {
    if m > SWEEP_PERIOD {
        crate::reactor::grid_after(now, m)
    } else {
        // A late round (a sweep held by the next stage) starts the next period from now: no
        // burst of rounds to catch up.
        (due + SWEEP_PERIOD).max(now)
    }
}

struct Task {
    name: String,
    /// Returns false when the role needs no more sweeps.
    sweep: Box<dyn FnMut() -> bool + Send>,
    /// Counts the task among the role's live work until it is dropped.
    _live: TallyGuard,
}

/// The sweeping thread of one stage.
pub struct Sweeper {
    tx: Sender<Task>,
    /// Unparked when a task is added, so that a new role's first sweep is not a period late.
    thread: std::thread::Thread,
}

impl Sweeper {
    /// The process's sweeper for `stage`, started on first use; it lives as long as the process
    /// (a node agent runs run after run on it).
    pub fn stage(stage: Stage) -> &'static Sweeper {
        static S: [OnceLock<Sweeper>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
        S[stage as usize].get_or_init(|| {
            let (tx, rx) = unbounded();
            let thread = std::thread::Builder::new()
                .name(format!("{}-sweep", stage.name()))
                .spawn(move || run(rx))
                .expect("start a sweeper")
                .thread()
                .clone();
            Sweeper { tx, thread }
        })
    }

    /// Runs `sweep` every [`SWEEP_PERIOD`] (or on the moderation grid, see there), the first
    /// time at once, until it returns false; the role counts it in `live` until then (as a
    /// connection handed to the pollers). A sweep that panics is logged and dropped, and the
    /// other roles' sweeps go on.
    pub fn add(
        &self,
        name: String,
        live: &Arc<Tally>,
        sweep: impl FnMut() -> bool + Send + 'static,
    ) {
        let task = Task {
            name,
            sweep: Box::new(sweep),
            _live: live.enter(),
        };
        // The sweeper's thread never ends, so its receiver never goes away.
        let _ = self.tx.send(task);
        self.thread.unpark();
    }
}

impl Sweeper {
    /// [`Self::add`] for `role`, which has finished only once the sweep has.
    pub fn add_to(
        &self,
        role: &mut crate::role::RoleThreads,
        name: String,
        sweep: impl FnMut() -> bool + Send + 'static,
    ) {
        let live = Arc::new(Tally::default());
        self.add(name, &live, sweep);
        role.polled.push(live);
    }
}

fn run(rx: Receiver<Task>) {
    let mut tasks: Vec<Task> = Vec::new();
    let mut next = Instant::now();
    loop {
        if tasks.is_empty() {
            match rx.recv() {
                Ok(t) => tasks.push(t),
                Err(_) => return,
            }
            next = Instant::now();
        }
        // Parked, not waiting in the channel: a channel's timed receive spins and yields the
        // core a few times before it sleeps, and again when it wakes, which was most of an idle
        // sweeper's CPU (200 times a second, every stage: docs/PERFORMANCE.md). `add` unparks
        // it, so new roles join at once rather than after the sleep; an early or spurious wake
        // only looks at the queue and parks again.
        let wait = next.saturating_duration_since(Instant::now());
        if !wait.is_zero() {
            std::thread::park_timeout(wait);
        }
        while let Ok(t) = rx.try_recv() {
            tasks.push(t);
        }
        if Instant::now() < next {
            continue;
        }
        tasks.retain_mut(|t| {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut t.sweep)) {
                Ok(again) => again,
                Err(_) => {
                    tracing::error!(role = %t.name, "a sweep panicked; its role sweeps no more");
                    false
                }
            }
        });
        next = next_round(next, Instant::now(), crate::reactor::moderation());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// Sweeps run every period, none in a burst after a late round, and on the links' grid
    /// when the moderation is the longer.
    #[test]
    fn rounds_follow_the_period_or_the_moderation_grid() {
        let due = Instant::now();
        assert_eq!(next_round(due, due, Duration::ZERO), due + SWEEP_PERIOD);
        assert_eq!(next_round(due, due, SWEEP_PERIOD), due + SWEEP_PERIOD);
        let late = due + 3 * SWEEP_PERIOD;
        assert_eq!(next_round(due, late, Duration::ZERO), late);
        let m = Duration::from_millis(20);
        let at = next_round(due, late, m);
        assert_eq!(at, crate::reactor::grid_after(late, m));
        assert!(at > late && at <= late + m);
    }

    /// Every role's sweep runs until it says it is done, on one thread, and the role's tally
    /// then falls to zero; a sweep that panics ends alone.
    #[test]
    fn sweeps_run_until_done_and_release_their_roles() {
        let s = Sweeper::stage(Stage::Send);
        let counts: Vec<Arc<AtomicU32>> = (0..3).map(|_| Arc::new(AtomicU32::new(0))).collect();
        let threads = Arc::new(parking_lot::Mutex::new(std::collections::HashSet::new()));
        let lives: Vec<Arc<Tally>> = (0..3).map(|_| Arc::new(Tally::default())).collect();
        for (i, (c, live)) in counts.iter().zip(&lives).enumerate() {
            let (c, threads) = (c.clone(), threads.clone());
            s.add(format!("test{i}"), live, move || {
                threads.lock().insert(std::thread::current().id());
                c.fetch_add(1, Ordering::Relaxed) + 1 < 3 * (i as u32 + 1)
            });
        }
        let broken = Arc::new(Tally::default());
        s.add("broken".into(), &broken, || panic!("a broken sweep"));
        for live in lives.iter().chain([&broken]) {
            live.wait_zero();
        }
        let ran: Vec<u32> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        assert_eq!(
            ran,
            vec![3, 6, 9],
            "each ran until it said done, and no more"
        );
        assert_eq!(threads.lock().len(), 1, "all on the stage's one thread");
    }
}

//! The threads of one running role and the two flags every role answers to: `stop` (take no new
//! connections; let links that never connected go; drain the rest) and `abort` (give up on links
//! still open, after the drain deadline).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

#[derive(Default)]
pub struct RoleThreads {
    pub stop: Arc<AtomicBool>,
    pub abort: Arc<AtomicBool>,
    pub threads: Vec<JoinHandle<()>>,
    /// Connections of the role served by the I/O pollers: the role has finished once they
    /// have, as once its threads have.
    pub polled: Vec<Arc<crate::reactor::Tally>>,
}

impl RoleThreads {
    /// Starts a named thread of this role.
    pub fn spawn(&mut self, name: String, f: impl FnOnce() + Send + 'static) {
        self.threads.push(spawn(name, f));
    }

    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    pub fn abort(&self) {
        self.stop.store(true, Ordering::Relaxed);
        self.abort.store(true, Ordering::Relaxed);
    }

    pub fn is_finished(&self) -> bool {
        self.threads.iter().all(|t| t.is_finished()) && self.polled.iter().all(|t| t.is_zero())
    }

    pub fn join(self) {
        for t in self.threads {
            let _ = t.join();
        }
        for t in self.polled {
            t.wait_zero();
        }
    }
}

/// Spawns a named thread (names show in `top -H`, `perf` and debuggers).
/// Joins the threads of `v` that have ended, so that a long-lived accept loop keeps only the
/// handles of the connections still served (an unjoined ended thread keeps its resources).
pub fn reap(v: &mut Vec<JoinHandle<()>>) {
    let mut i = 0;
    while i < v.len() {
        if v[i].is_finished() {
            let _ = v.swap_remove(i).join();
        } else {
            i += 1;
        }
    }
}

pub fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> JoinHandle<()> {
    std::thread::Builder::new()
        .name(name)
        .spawn(f)
        .expect("spawn thread")
}

/// CPU time (user and system) the calling thread has used, in nanoseconds.
pub fn thread_cpu_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given; the thread clock always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

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

/// Time spent in one kind of wait, readable while a wait goes on: a multi-second wait shows
/// while it lasts (status line, dashboard, bottleneck), not only when it ends. One waiter at a
/// time.
#[derive(Debug, Default)]
pub struct Stopwatch {
    total_ns: std::sync::atomic::AtomicU64,
    /// When the wait under way began, in nanoseconds from [`epoch`] plus one (0: none).
    since: std::sync::atomic::AtomicU64,
}

/// A process-wide origin for [`Stopwatch`] readings.
fn epoch() -> std::time::Instant {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(std::time::Instant::now)
}

fn since_epoch_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

impl Stopwatch {
    /// Times `f` as one wait.
    pub fn time<T>(&self, f: impl FnOnce() -> T) -> T {
        use std::sync::atomic::Ordering::{Relaxed, Release};
        let t0 = since_epoch_ns();
        self.since.store(t0 + 1, Release);
        let out = f();
        let t1 = since_epoch_ns();
        // Ended before it is added: a reader sees the wait in `since` or in `total`, at worst
        // in neither for an instant, never twice.
        self.since.store(0, Release);
        self.total_ns.fetch_add(t1.saturating_sub(t0), Relaxed);
        out
    }

    /// Nanoseconds waited so far, the wait under way included.
    pub fn ns(&self) -> u64 {
        use std::sync::atomic::Ordering::{Acquire, Relaxed};
        let since = self.since.load(Acquire);
        let total = self.total_ns.load(Relaxed);
        if since == 0 {
            total
        } else {
            total + since_epoch_ns().saturating_sub(since - 1)
        }
    }
}

/// CPU time (user and system) every thread of this process has used, in nanoseconds.
pub fn process_cpu_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given; the process clock always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// Nanoseconds the threads of this process have spent ready to run but waiting for a core (the
/// scheduler's run delay, `/proc/self/task/*/schedstat`), summed over the live threads: what a
/// CPU quota or a host short of cores costs a process, seen from inside it (its control group's
/// files may be out of sight, as in a network namespace's own `/sys`). Threads that have ended
/// take their share with them. 0 where the kernel keeps no schedstats.
pub fn process_cpu_wait_ns() -> u64 {
    schedstat_sum(SCHEDSTAT_WAIT, None)
}

/// The cores this process may use now: the CPUs it may run on, or less where its control group
/// has a CPU quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`), as Kubernetes CPU limits and
/// systemd's `CPUQuota=` set. Read afresh on each call: a quota can change while a process runs.
/// A stage whose host uses nearly all of this is CPU-bound, whatever its buffers say.
pub fn cpu_allowance() -> f64 {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let affinity = {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity fills it.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let ok = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) } == 0;
        if ok {
            (unsafe { libc::CPU_COUNT(&set) }).max(1) as f64
        } else {
            cpus
        }
    };
    match cgroup_quota() {
        Some(q) => affinity.min(q),
        None => affinity,
    }
}

/// This process's CPU quota in cores, from its own control group (the tightest of v1 and v2).
fn cgroup_quota() -> Option<f64> {
    let groups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut best: Option<f64> = None;
    let mut keep = |q: f64| best = Some(best.map_or(q, |b: f64| b.min(q)));
    for line in groups.lines() {
        let mut f = line.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        let path = path.trim_start_matches('/');
        if controllers.is_empty() {
            for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
                let max = std::fs::read_to_string(format!("{root}/{path}/cpu.max"));
                if let Some(q) = max.ok().and_then(|m| quota_v2(&m)) {
                    keep(q);
                }
            }
        } else if controllers.split(',').any(|c| c == "cpu") {
            let dir = format!("/sys/fs/cgroup/{controllers}/{path}");
            let read = |f: &str| -> Option<i64> {
                std::fs::read_to_string(format!("{dir}/{f}"))
                    .ok()?
                    .trim()
                    .parse()
                    .ok()
            };
            if let (Some(q), Some(p)) = (read("cpu.cfs_quota_us"), read("cpu.cfs_period_us")) {
                if q > 0 && p > 0 {
                    keep(q as f64 / p as f64);
                }
            }
        }
    }
    best
}

/// `cpu.max` ("QUOTA PERIOD", QUOTA `max` for none) in cores.
fn quota_v2(text: &str) -> Option<f64> {
    let mut f = text.split_whitespace();
    let q: f64 = f.next()?.parse().ok()?;
    let p: f64 = f.next()?.parse().ok()?;
    (q > 0.0 && p > 0.0).then_some(q / p)
}

/// Nanoseconds on a core (`/proc/self/task/*/schedstat`, user and system) of this process's
/// live threads whose name passes `named`: one role's share of a process that runs several,
/// as the threads carry their role in their names. 0 where the kernel keeps no schedstats.
pub fn threads_cpu_ns(named: impl Fn(&str) -> bool) -> u64 {
    schedstat_sum(SCHEDSTAT_RUN, Some(&named))
}

/// The fields of a thread's `schedstat`: "run_ns wait_ns timeslices".
const SCHEDSTAT_RUN: usize = 0;
const SCHEDSTAT_WAIT: usize = 1;

/// Sums one field of `/proc/self/task/*/schedstat` over the live threads whose name passes
/// `named` (every thread when `None`, without reading their names). One buffer serves every
/// read: the live view calls this every sample.
fn schedstat_sum(field: usize, named: Option<&dyn Fn(&str) -> bool>) -> u64 {
    use std::io::Read;
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    let read = |path: std::path::PathBuf, buf: &mut String| {
        buf.clear();
        std::fs::File::open(path)
            .and_then(|mut f| f.read_to_string(buf))
            .is_ok()
    };
    let mut total = 0u64;
    let mut buf = String::with_capacity(64);
    for t in tasks.flatten() {
        if let Some(named) = named {
            if !read(t.path().join("comm"), &mut buf) || !named(buf.trim_end()) {
                continue;
            }
        }
        if read(t.path().join("schedstat"), &mut buf) {
            if let Some(v) = buf
                .split_whitespace()
                .nth(field)
                .and_then(|v| v.parse::<u64>().ok())
            {
                total += v;
            }
        }
    }
    total
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A named thread's CPU is found by its name, and only its: the spinning thread's time
    /// counts, the idle caller's (another name) does not.
    #[test]
    fn threads_cpu_is_summed_by_name() {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s2 = stop.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::Builder::new()
            .name("cpu-probe".into())
            .spawn(move || {
                let t0 = thread_cpu_ns();
                while thread_cpu_ns() - t0 < 50_000_000 {
                    std::hint::spin_loop();
                }
                tx.send(()).unwrap();
                while !s2.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::park();
                }
            })
            .unwrap();
        rx.recv().unwrap();
        let probe = threads_cpu_ns(|n| n == "cpu-probe");
        let none = threads_cpu_ns(|n| n == "no-such-thread");
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        t.thread().unpark();
        t.join().unwrap();
        assert!(probe >= 40_000_000, "{probe} ns");
        assert_eq!(none, 0);
    }

    /// Two threads that each spin for 50 ms of CPU on the one core they may use must wait for
    /// each other: the process's run delay grows by at least the shorter one's wait.
    #[test]
    fn threads_waiting_for_a_core_are_counted() {
        if !std::path::Path::new("/proc/self/schedstat").exists() {
            return; // a kernel without schedstats reports 0, as documented
        }
        let before = process_cpu_wait_ns();
        let spinners: Vec<_> = (0..2)
            .map(|_| {
                std::thread::spawn(|| {
                    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET fills one bit.
                    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
                    unsafe { libc::CPU_SET(0, &mut set) };
                    let pinned =
                        unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) }
                            == 0;
                    let t0 = thread_cpu_ns();
                    while thread_cpu_ns() - t0 < 50_000_000 {
                        std::hint::spin_loop();
                    }
                    // Counted before the thread ends, which takes its share with it.
                    (pinned, process_cpu_wait_ns())
                })
            })
            .collect();
        let seen: Vec<(bool, u64)> = spinners.into_iter().map(|t| t.join().unwrap()).collect();
        if seen.iter().any(|(pinned, _)| !pinned) {
            return; // CPU 0 is not ours to pin to (a restricted cpuset)
        }
        let waited = seen.iter().map(|&(_, w)| w).max().unwrap() - before;
        assert!(waited >= 10_000_000, "{waited} ns of run delay");
    }

    #[test]
    fn a_cgroup_v2_quota_reads_in_cores_and_max_is_none() {
        assert_eq!(quota_v2("20000 100000\n"), Some(0.2));
        assert_eq!(quota_v2("max 100000\n"), None);
        assert_eq!(quota_v2(""), None);
        let w = Stopwatch::default();
        let inside = w.time(|| {
            std::thread::sleep(std::time::Duration::from_millis(2));
            w.ns()
        });
        assert!(inside >= 2_000_000, "a wait under way is counted: {inside}");
        assert!(w.ns() >= inside);
        let a = cpu_allowance();
        assert!(a > 0.0 && a <= std::thread::available_parallelism().unwrap().get() as f64);
    }
}

//! A byte budget: the hard memory bound of one link's buffer. Taking from an exhausted budget
//! blocks, which stops the link's reads, which lets TCP hold the sender: back-pressure instead of
//! growth. The time spent blocked is counted as busy time.

use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Budget {
    limit: u64,
    used: Mutex<u64>,
    freed: Condvar,
    /// Nanoseconds callers spent waiting for memory.
    pub busy_ns: AtomicU64,
    /// High-water mark of `used`.
    pub peak: AtomicU64,
}

impl Budget {
    pub fn new(limit: u64) -> Budget {
        Budget {
            limit,
            used: Mutex::new(0),
            freed: Condvar::new(),
            busy_ns: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn used(&self) -> u64 {
        *self.used.lock()
    }

    /// Takes `n` bytes, waiting while the budget is exhausted. Returns false if `stop` was raised
    /// while waiting (nothing is taken then). A request larger than the whole budget waits for an
    /// empty budget and then takes it, so one oversized chunk cannot deadlock.
    pub fn take(&self, n: u64, stop: &AtomicBool) -> bool {
        let mut used = self.used.lock();
        let fits = |u: u64| u + n <= self.limit || u == 0;
        if !fits(*used) {
            let t0 = Instant::now();
            while !fits(*used) {
                if stop.load(Ordering::Relaxed) {
                    self.busy_ns
                        .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    return false;
                }
                self.freed.wait_for(&mut used, Duration::from_millis(50));
            }
            self.busy_ns
                .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        *used += n;
        self.peak.fetch_max(*used, Ordering::Relaxed);
        true
    }

    /// Whether `n` more bytes would fit right now.
    pub fn would_block(&self, n: u64) -> bool {
        let u = *self.used.lock();
        u + n > self.limit && u != 0
    }

    pub fn give(&self, n: u64) {
        let mut used = self.used.lock();
        *used = used.saturating_sub(n);
        drop(used);
        self.freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn blocks_until_given_back() {
        let b = Arc::new(Budget::new(100));
        let stop = AtomicBool::new(false);
        assert!(b.take(60, &stop));
        assert!(b.would_block(60));
        let b2 = b.clone();
        let h = std::thread::spawn(move || {
            let stop = AtomicBool::new(false);
            b2.take(60, &stop)
        });
        b.give(60);
        assert!(h.join().unwrap());
        assert_eq!(b.used(), 60);
    }

    #[test]
    fn stop_releases_waiter() {
        let b = Budget::new(10);
        let stop = AtomicBool::new(false);
        assert!(b.take(10, &stop));
        stop.store(true, Ordering::Relaxed);
        assert!(!b.take(1, &stop));
        assert_eq!(b.used(), 10);
    }
}

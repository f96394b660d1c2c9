//! A byte budget: the hard memory bound of one link's buffer. Taking from an exhausted budget
//! blocks, which stops the link's reads, which lets TCP hold the sender: back-pressure instead of
//! growth. The time spent blocked is counted as busy time.
//!
//! The budget also keeps the link's freed chunks for reuse, most recent first: a reused chunk is
//! warm in cache and costs no page faults and no zeroing (fresh chunks cost 18 % of all CPU in a
//! 16 KiB building profile before this). Kept chunks count against the limit, so
//! `used + pooled <= limit` always holds.

use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::reactor::Doorbell;

#[derive(Debug, Default)]
struct State {
    used: u64,
    pooled: u64,
    pool: Vec<Box<[u8]>>,
    /// Poller-served readers that found the budget exhausted (several if several readers share
    /// it): rung when memory comes back, so a held link reads again at once instead of at its
    /// next timed look.
    waiters: Vec<Doorbell>,
    /// A take found the budget exhausted, and no memory has been given back since.
    refused: bool,
}

enum Taken {
    Kept(Box<[u8]>),
    Fresh,
}

impl Taken {
    /// The buffer of `n` bytes: called with the budget's lock released, since a fresh one is
    /// zeroed and faulted in, which takes long for a megabyte.
    fn buffer(self, n: usize) -> Box<[u8]> {
        match self {
            Taken::Kept(b) => b,
            Taken::Fresh => touched(n),
        }
    }
}

#[derive(Debug)]
pub struct Budget {
    limit: u64,
    state: Mutex<State>,
    freed: Condvar,
    /// Nanoseconds callers spent waiting for memory.
    pub busy_ns: AtomicU64,
    /// High-water mark of the bytes in use.
    pub peak: AtomicU64,
}

impl Budget {
    pub fn new(limit: u64) -> Budget {
        Budget {
            limit,
            state: Mutex::new(State::default()),
            freed: Condvar::new(),
            busy_ns: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes in chunks that hold data (not counting kept free chunks).
    pub fn used(&self) -> u64 {
        self.state.lock().used
    }

    /// Takes a buffer of at least `min` and preferably `n` bytes, waiting while the budget is
    /// exhausted: a kept chunk of any size from `min` up if there is one (reused memory, warm in
    /// cache), else a fresh zero-initialised one of `n` bytes, its pages faulted in with one
    /// call ([`touched`]) rather than one fault per page inside the first read (at 16 x 60,
    /// where every link's first chunks are fresh, whole runs took 10 % less CPU). `None` if `stop` was raised while
    /// waiting. A request larger than the whole budget waits for an empty budget and then takes
    /// it, so one oversized message cannot deadlock a link.
    pub fn take_buffer(&self, min: usize, n: usize, stop: &AtomicBool) -> Option<Box<[u8]>> {
        let mut s = self.state.lock();
        loop {
            if let Some(t) = self.take_locked(&mut s, min, n) {
                drop(s);
                return Some(t.buffer(n));
            }
            s.refused = true;
            if stop.load(Ordering::Relaxed) {
                return None;
            }
            // Counted per wait of at most 50 ms, not when the whole wait ends: a stall of
            // seconds shows as busy while it lasts (status line, dashboard, /metrics).
            let t = Instant::now();
            self.freed.wait_for(&mut s, Duration::from_millis(50));
            self.busy_ns
                .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
    }

    /// [`Self::take_buffer`] without waiting (for a poller, which must not block): `None` when
    /// the budget is exhausted, and then `bell` is rung by the next [`Self::give_buffer`].
    /// Decided under the lock that frees memory, so no release between the refusal and the
    /// wait can be missed.
    pub fn try_take_buffer(&self, min: usize, n: usize, bell: &Doorbell) -> Option<Box<[u8]>> {
        let mut s = self.state.lock();
        if let Some(t) = self.take_locked(&mut s, min, n) {
            drop(s);
            return Some(t.buffer(n));
        }
        s.refused = true;
        if !s.waiters.iter().any(|w| w.same(bell)) {
            s.waiters.push(bell.clone());
        }
        None
    }

    /// Whether a reader's latest take was refused (waiting, or told to come back) and no memory
    /// has been given back since: then that take, not a guess, says the reader cannot read.
    /// Memory given back clears this until a take is refused again, so a reader that has memory
    /// waiting for it but has not run yet is never taken for held.
    pub fn refused_since_given(&self) -> bool {
        self.state.lock().refused
    }

    /// [`Self::take_buffer`] if memory is there now: never waits and leaves no doorbell. For a
    /// reader that can still let go of what it holds and ask again the waiting way.
    pub fn take_now(&self, min: usize, n: usize) -> Option<Box<[u8]>> {
        let t = self.take_locked(&mut self.state.lock(), min, n)?;
        Some(t.buffer(n))
    }

    fn take_locked(&self, s: &mut State, min: usize, n: usize) -> Option<Taken> {
        let n64 = n as u64;
        // Any kept chunk that is big enough: a link whose chunk size follows its rate must not
        // take fresh memory while it keeps chunks of another size (every byte of a 16 x 60
        // trapezoid run was a page fault before this).
        if let Some(i) = s.pool.iter().rposition(|b| b.len() >= min) {
            let b = s.pool.remove(i);
            let len = b.len() as u64;
            s.pooled -= len;
            s.used += len;
            self.peak.fetch_max(s.used, Ordering::Relaxed);
            return Some(Taken::Kept(b));
        }
        // Kept chunks of another size make room for this one.
        while s.used + s.pooled + n64 > self.limit && !s.pool.is_empty() {
            let b = s.pool.remove(0);
            s.pooled -= b.len() as u64;
        }
        if s.used + s.pooled + n64 <= self.limit || s.used == 0 {
            s.used += n64;
            self.peak.fetch_max(s.used, Ordering::Relaxed);
            // Zeroed outside the lock by the caller.
            return Some(Taken::Fresh);
        }
        None
    }

    /// Fills the budget with kept chunks of `chunk` bytes, as many as fit beside what is in use
    /// and kept, every page of them written now: memory reserved at configure, as DAQs do, so
    /// that data taking never waits for the kernel to find and zero a page (first touch was 19 %
    /// of all CPU in a 16 x 60 trapezoid with default buffers, docs/PERFORMANCE.md). The bound
    /// is unchanged: kept chunks count against the limit. Returns the bytes reserved.
    pub fn reserve(&self, chunk: usize) -> u64 {
        if chunk == 0 {
            return 0;
        }
        let count = {
            let s = self.state.lock();
            self.limit.saturating_sub(s.used + s.pooled) / chunk as u64
        };
        // Made outside the lock: a link may already read (a unit started while its sources
        // connect), and touching megabytes takes milliseconds.
        let made: Vec<Box<[u8]>> = (0..count).map(|_| touched(chunk)).collect();
        let mut s = self.state.lock();
        let mut reserved = 0;
        for b in made {
            let n = b.len() as u64;
            if s.used + s.pooled + n <= self.limit {
                s.pooled += n;
                reserved += n;
                s.pool.push(b);
            }
        }
        reserved
    }

    /// Bytes in kept chunks, free for the link's next reads.
    pub fn kept(&self) -> u64 {
        self.state.lock().pooled
    }

    /// Whether `n` more bytes would have to wait right now (the link is BUSY).
    pub fn would_block(&self, n: u64) -> bool {
        let s = self.state.lock();
        let reusable = s.pool.iter().any(|b| b.len() as u64 == n);
        !reusable && s.used + n > self.limit && s.used != 0
    }

    /// Returns a buffer taken with [`Self::take_buffer`]; it is kept for reuse.
    pub fn give_buffer(&self, b: Box<[u8]>) {
        let n = b.len() as u64;
        let mut s = self.state.lock();
        s.used = s.used.saturating_sub(n);
        if s.used + s.pooled + n <= self.limit {
            s.pooled += n;
            s.pool.push(b);
        }
        s.refused = false;
        let waiters = std::mem::take(&mut s.waiters);
        drop(s);
        self.freed.notify_all();
        for bell in waiters {
            bell.ring();
        }
    }
}

/// [`Budget::reserve`] of every budget of `role`, on as many threads as there are cores: the
/// kernel's zeroing of fresh pages is most of it, and it runs in parallel. Returns the bytes
/// reserved, and logs them with the time it took.
pub fn reserve_all<'a>(role: &str, budgets: impl Iterator<Item = &'a Budget>, chunk: usize) -> u64 {
    let t = Instant::now();
    let budgets: Vec<&Budget> = budgets.collect();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(budgets.len())
        .max(1);
    let per = budgets.len().div_ceil(threads).max(1);
    let bytes = std::thread::scope(|s| {
        let parts: Vec<_> = budgets
            .chunks(per)
            .map(|part| s.spawn(move || part.iter().map(|b| b.reserve(chunk)).sum::<u64>()))
            .collect();
        parts
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .sum()
    });
    tracing::info!(
        role,
        bytes,
        ms = t.elapsed().as_millis() as u64,
        "buffers reserved"
    );
    bytes
}

/// A zeroed buffer whose every page is already the process's: a large zeroed allocation is
/// only a promise of zero pages, kept at the first write to each. The kernel faults the whole
/// page-aligned interior in at once (`MADV_POPULATE_WRITE`, Linux 5.14 on: 0.54 against 0.79
/// s per GB written a page at a time, on this machine, 1 MiB chunks); the partial pages at the
/// ends, and everything where the advice is refused, are written once per page.
fn touched(n: usize) -> Box<[u8]> {
    const PAGE: usize = 4096;
    let mut b = vec![0u8; n].into_boxed_slice();
    let p = b.as_mut_ptr();
    let (addr, end) = (p as usize, p as usize + n);
    let (inner, inner_end) = (addr.next_multiple_of(PAGE), end / PAGE * PAGE);
    // SAFETY: [inner, inner_end) is page-aligned and inside the allocation just made, which
    // nothing else refers to; populating only faults its pages in, keeping their (zero) bytes.
    let populated = inner < inner_end
        && unsafe {
            libc::madvise(
                inner as *mut libc::c_void,
                inner_end - inner,
                libc::MADV_POPULATE_WRITE,
            )
        } == 0;
    let write = |i: usize| {
        // SAFETY: `i < n`, inside the allocation; volatile so that the store of a zero over a
        // zero is not dropped as redundant.
        unsafe { std::ptr::write_volatile(p.add(i), 0) }
    };
    if populated {
        write(0);
        write(n - 1);
    } else {
        (0..n).step_by(PAGE).for_each(write);
        if n > 0 {
            write(n - 1);
        }
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn blocks_until_given_back_and_reuses() {
        let b = Arc::new(Budget::new(100));
        let stop = AtomicBool::new(false);
        let x = b.take_buffer(60, 60, &stop).unwrap();
        assert!(b.would_block(60));
        let ptr = x.as_ptr();
        let b2 = b.clone();
        let h = std::thread::spawn(move || {
            let stop = AtomicBool::new(false);
            let got = b2.take_buffer(60, 60, &stop).unwrap();
            got.as_ptr() as usize
        });
        b.give_buffer(x);
        assert_eq!(
            h.join().unwrap(),
            ptr as usize,
            "the freed buffer is reused"
        );
        assert_eq!(b.used(), 60);
    }

    #[test]
    fn stop_releases_waiter_and_pool_respects_limit() {
        let b = Budget::new(10);
        let stop = AtomicBool::new(false);
        let x = b.take_buffer(10, 10, &stop).unwrap();
        stop.store(true, Ordering::Relaxed);
        assert!(b.take_buffer(1, 1, &stop).is_none());
        b.give_buffer(x);
        stop.store(false, Ordering::Relaxed);
        // A kept buffer big enough is taken whatever its size (no fresh memory)...
        let y = b.take_buffer(4, 4, &stop).unwrap();
        assert_eq!(y.len(), 10);
        assert_eq!(b.used(), 10);
        b.give_buffer(y);
        // ...one too small is evicted rather than exceeding the limit.
        let z = b.take_buffer(10, 10, &stop).unwrap();
        b.give_buffer(z);
        let big = Budget::new(10);
        let small = big.take_buffer(6, 6, &stop).unwrap();
        big.give_buffer(small);
        let w = big.take_buffer(8, 8, &stop).unwrap();
        assert_eq!(w.len(), 8);
        assert_eq!(big.used(), 8);
    }

    /// A reserved budget is full of kept chunks and still bounded; a link then takes kept
    /// chunks only (no fresh memory), and what it gives back is kept again.
    #[test]
    fn a_reserved_budget_is_kept_chunks_within_the_limit() {
        let b = Budget::new(1000);
        let stop = AtomicBool::new(false);
        let x = b.take_buffer(300, 300, &stop).unwrap();
        assert_eq!(
            b.reserve(128),
            5 * 128,
            "five chunks fit beside the 300 in use"
        );
        assert_eq!((b.used(), b.kept()), (300, 640));
        assert_eq!(b.reserve(128), 0, "a second reserve adds nothing");
        let mut held = Vec::new();
        for _ in 0..5 {
            let y = b.take_buffer(100, 128, &stop).unwrap();
            assert_eq!(y.len(), 128, "a kept chunk, not a fresh one");
            held.push(y);
        }
        assert_eq!((b.used(), b.kept()), (940, 0));
        assert!(b.would_block(128), "the limit holds after a reserve");
        b.give_buffer(x);
        for y in held {
            b.give_buffer(y);
        }
        assert_eq!((b.used(), b.kept()), (0, 940));
        assert_eq!(Budget::new(100).reserve(0), 0);
    }

    /// Reserved chunks are resident: every page of them is in memory before any read (the
    /// kernel's own record, `mincore`), where a fresh zeroed allocation of the same size is
    /// not.
    #[test]
    fn reserved_chunks_are_resident() {
        fn resident_pages(b: &[u8]) -> (usize, usize) {
            // SAFETY: sysconf has no preconditions.
            let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
            let start = (b.as_ptr() as usize).next_multiple_of(page);
            let end = (b.as_ptr() as usize + b.len()) / page * page;
            let n = (end - start) / page;
            let mut v = vec![0u8; n];
            // SAFETY: [start, end) is page-aligned and inside the live allocation `b`.
            let rc =
                unsafe { libc::mincore(start as *mut libc::c_void, end - start, v.as_mut_ptr()) };
            assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
            (v.iter().filter(|&&x| x & 1 == 1).count(), n)
        }
        const CHUNK: usize = 4 << 20;
        let b = Budget::new(4 * CHUNK as u64);
        assert_eq!(b.reserve(CHUNK), 4 * CHUNK as u64);
        let s = b.state.lock();
        assert_eq!(s.pool.len(), 4);
        for c in &s.pool {
            let (resident, pages) = resident_pages(c);
            assert_eq!(
                resident, pages,
                "every page of a reserved chunk is resident"
            );
        }
        drop(s);
        let fresh = vec![0u8; CHUNK].into_boxed_slice();
        let (resident, pages) = resident_pages(&fresh);
        assert!(
            resident < pages / 2,
            "a fresh allocation is not resident ({resident} of {pages} pages), so the test can tell"
        );
    }

    /// Issue 14: a stall shows as busy while it lasts, not only once it ends.
    #[test]
    fn a_wait_counts_as_busy_while_it_lasts() {
        let b = Arc::new(Budget::new(100));
        let stop = Arc::new(AtomicBool::new(false));
        let all = b.take_buffer(100, 100, &stop).unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let (b2, s2, d2) = (b.clone(), stop.clone(), done.clone());
        let waiter = std::thread::spawn(move || {
            let got = b2.take_buffer(10, 10, &s2);
            d2.store(true, Ordering::Release);
            got.is_some()
        });
        let t = Instant::now();
        while b.busy_ns.load(Ordering::Relaxed) == 0 {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "no busy time while waiting"
            );
            std::thread::yield_now();
        }
        assert!(
            !done.load(Ordering::Acquire),
            "counted only after the wait ended"
        );
        b.give_buffer(all);
        assert!(waiter.join().unwrap());
    }

    /// A refusal stands as the reader's proof only until memory comes back: from then until the
    /// reader looks again, it is not held, whatever its state says.
    #[test]
    fn a_refusal_stands_only_until_memory_comes_back() {
        let b = Budget::new(100);
        let stop = AtomicBool::new(false);
        let bell = Doorbell::default();
        assert!(!b.refused_since_given(), "nobody looked yet");
        let all = b.take_buffer(100, 100, &stop).unwrap();
        assert!(b.try_take_buffer(60, 60, &bell).is_none());
        assert!(b.refused_since_given(), "the look found nothing");
        b.give_buffer(all);
        assert!(
            !b.refused_since_given(),
            "memory came back after the look: the reader is owed a new look"
        );
        // The kept chunk of 100 is taken whole.
        let again = b.try_take_buffer(60, 60, &bell).unwrap();
        assert!(!b.refused_since_given(), "the new look was given memory");
        assert!(b.try_take_buffer(60, 60, &bell).is_none());
        assert!(b.refused_since_given(), "refused again");
        b.give_buffer(again);
        // A blocking take that waits is refused the same way, until memory comes back.
        let all = b.take_buffer(100, 100, &stop).unwrap();
        let b = Arc::new(b);
        let waiter = {
            let b = b.clone();
            std::thread::spawn(move || b.take_buffer(60, 60, &AtomicBool::new(false)).is_some())
        };
        while !b.refused_since_given() {
            std::thread::yield_now();
        }
        b.give_buffer(all);
        assert!(
            !b.refused_since_given(),
            "given back: the waiter is owed its take"
        );
        assert!(waiter.join().unwrap());
    }

    /// A poller-served link refused memory is turned again as soon as memory is given back,
    /// although it said it is blocked for an hour: the budget rings its bell, and the poller
    /// answers a bell even for a blocked connection. Without either, this waits the hour.
    #[test]
    fn a_link_refused_memory_is_turned_when_memory_comes_back() {
        use crate::reactor::{Conn, Next, Reactor};
        use std::net::{TcpListener, TcpStream};
        use std::os::fd::{AsRawFd, RawFd};
        use std::sync::mpsc;

        struct Held {
            s: TcpStream,
            budget: Arc<Budget>,
            bell: Doorbell,
            turns: u32,
            told: mpsc::Sender<u32>,
        }
        impl Conn for Held {
            fn fd(&self) -> RawFd {
                self.s.as_raw_fd()
            }
            fn doorbell(&self) -> Option<&Doorbell> {
                Some(&self.bell)
            }
            fn turn(&mut self) -> Next {
                self.bell.answer();
                self.turns += 1;
                match self.budget.try_take_buffer(60, 60, &self.bell) {
                    Some(b) => {
                        self.budget.give_buffer(b);
                        let _ = self.told.send(self.turns);
                        Next::Done
                    }
                    None => {
                        let _ = self.told.send(0);
                        Next::At(Instant::now() + Duration::from_secs(3600))
                    }
                }
            }
        }

        let budget = Arc::new(Budget::new(100));
        let stop = AtomicBool::new(false);
        let all = budget.take_buffer(100, 100, &stop).unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let _peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let (told, heard) = mpsc::channel();
        let r = Reactor::new(1, "test").unwrap();
        r.register(Box::new(Held {
            s,
            budget: budget.clone(),
            bell: Doorbell::default(),
            turns: 0,
            told,
        }));
        let wait = Duration::from_secs(60);
        assert_eq!(heard.recv_timeout(wait).unwrap(), 0, "refused at first");
        budget.give_buffer(all);
        let turns = heard
            .recv_timeout(wait)
            .expect("not turned when memory came back");
        assert_eq!(turns, 2, "it read on the turn the bell gave it");
    }
}

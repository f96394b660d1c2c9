//! The memory bounds `tessera check` counts, held against what the allocator hands out: an
//! assembler driven to its cap on open events in the shapes that grow its parts (a ring that
//! doubles, every event in the overflow map, deleted marks in that map, events opened out of
//! order, events passed by a promise and not yet taken, no sweep for a long while), and a set of
//! recent IDs churned far past its capacity. Each is measured at its peak of live heap bytes.
//!
//! One test function: the allocator's counts are the whole process's, so nothing else may run
//! beside it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use tessera_assembly::{Assembler, Offer, RecentSet};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, Relaxed) + by;
    PEAK.fetch_max(now, Relaxed);
}

// SAFETY: every call is passed on to the system allocator unchanged; only counts are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            // The old block and the new one may both be live while it copies.
            grew(new);
            LIVE.fetch_sub(l.size(), Relaxed);
        }
        q
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Runs `f` and returns the most heap bytes live above what was live before it.
fn peak_of(f: impl FnOnce()) -> usize {
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    f();
    PEAK.load(Relaxed) - base
}

/// An item of the size of a readout unit's slice of a chunk.
type Item = [u64; 4];

const N: usize = 8;
const MAX_OPEN: usize = 3000;
const MEMORY: usize = 1 << 12;

fn drive(a: &mut Assembler<Item>) {
    let mut now = 0u64;
    // As the readout units and builders do: the events a promise or a later item passed are
    // taken after every offer and promise, and every part list is given back.
    let take = |a: &mut Assembler<Item>, o: Offer<Item>| {
        let passed: Vec<_> = a.take_passed().collect();
        for e in passed {
            a.recycle(e.parts);
        }
        if let Offer::Ready(e) = o {
            a.recycle(e.parts);
        }
    };
    // A cluster of events at consecutive IDs up to the cap: the ring doubles up to it, and
    // offers past the cap are refused.
    for round in 0..3u64 {
        let base = round * 1_000_000;
        for ev in base..base + MAX_OPEN as u64 + 100 {
            now += 1;
            let o = a.offer(0, ev, [ev; 4], now);
            take(a, o);
        }
        // Completed in an order that is not the IDs'.
        for c in 1..N {
            for k in 0..MAX_OPEN as u64 {
                let ev = base + (k * 7919) % MAX_OPEN as u64;
                let o = a.offer(c, ev, [ev; 4], now);
                take(a, o);
            }
        }
    }
    // Events that all share one ring slot: every one but the first goes to the overflow map,
    // opened and completed again and again so that deletions mark it.
    for round in 0..6u64 {
        let base = 10_000_000 + round * (1 << 40);
        let ids: Vec<u64> = (0..MAX_OPEN as u64).map(|k| base + (k << 20)).collect();
        for &ev in ids.iter().rev() {
            let o = a.offer(0, ev, [ev; 4], now);
            take(a, o);
        }
        for c in 1..N {
            for k in 0..ids.len() {
                let ev = ids[(k * 31) % ids.len()];
                let o = a.offer(c, ev, [ev; 4], now);
                take(a, o);
            }
        }
    }
    // Events a promise passes, left in the assembler until the next offers are done.
    let base = 1u64 << 50;
    for ev in base..base + MAX_OPEN as u64 {
        let o = a.offer(0, ev, [ev; 4], now);
        take(a, o);
    }
    let mut passed = 0;
    for c in 1..N {
        a.promise_floor(c, base + MAX_OPEN as u64);
        passed += a.take_passed().count();
    }
    assert_eq!(passed, MAX_OPEN, "the promises passed every open event");
    for c in 0..N {
        for ev in base + MAX_OPEN as u64..base + 2 * MAX_OPEN as u64 {
            let o = a.offer(c, ev, [ev; 4], now);
            take(a, o);
        }
    }
    assert_eq!(a.pending_events(), 0);
    // Many events that leave from behind one that waits, with no sweep: the order queue
    // keeps their entries until it is compacted.
    let held = base + 3 * MAX_OPEN as u64;
    let o = a.offer(0, held, [0; 4], now);
    take(a, o);
    let built = a.stats.complete;
    for ev in held + 1..held + 300_000 {
        for c in 0..N {
            let o = a.offer(c, ev, [ev; 4], now);
            take(a, o);
        }
    }
    assert_eq!(a.stats.complete - built, 300_000 - 1);
    assert_eq!(a.pending_events(), 1);
    let _ = a.expire(now + 1);
}

#[test]
fn bookkeeping_stays_within_what_check_counts() {
    // The assembler's bookkeeping.
    let bound = Assembler::<Item>::bytes_at_most(N, MAX_OPEN, MEMORY) as usize;
    let peak = peak_of(|| {
        let mut a = Assembler::<Item>::new(N, u64::MAX / 4, MEMORY).with_max_open(MAX_OPEN);
        drive(&mut a);
        assert!(a.stats.full > 0, "the cap was reached");
        drop(a);
    });
    println!("assembler: peak {peak} bytes, bound {bound}");
    assert!(peak <= bound, "assembler: peak {peak} > bound {bound}");
    // The bound is no blanket: within four times the peak of this drive.
    assert!(
        bound < 4 * peak,
        "assembler: bound {bound} for a peak of {peak}"
    );

    // A set of recent IDs, far past its capacity, out of order.
    for capacity in [1usize, 1000, 1 << 16] {
        let bound = RecentSet::bytes(capacity) as usize;
        let peak = peak_of(|| {
            let mut r = RecentSet::new(capacity);
            let mut last = 0;
            for i in 0..10 * capacity as u64 + 10 {
                last = i ^ ((i >> 3) & 7);
                r.insert(last);
            }
            assert!(r.contains(last));
        });
        println!("recent set of {capacity}: peak {peak} bytes, bound {bound}");
        assert!(
            peak <= bound,
            "recent set of {capacity}: peak {peak} > bound {bound}"
        );
    }
}

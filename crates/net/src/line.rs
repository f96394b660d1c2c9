//! Keeping an order across a hand-off. A decision is taken under one lock (which events left an
//! assembler, which event's first step completed) and acted on after releasing it (queueing to
//! builders, sending requests), so that one thread's slow hand-off never holds the lock. Two
//! threads then race between the two, and a later decision can overtake an earlier one. A
//! [`Ticket`] taken under the deciding lock restores the order: each hand-off waits for the one
//! before it.

use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicU64, Ordering};

/// The tickets of one ordered hand-off.
#[derive(Debug, Default)]
pub struct Line {
    next: AtomicU64,
    /// The ticket whose turn it is.
    turn: Mutex<u64>,
    passed: Condvar,
}

impl Line {
    /// A place in line: take it where the order is decided (under the lock that decides it).
    pub fn ticket(&self) -> Ticket<'_> {
        Ticket {
            n: self.next.fetch_add(1, Ordering::Relaxed),
            line: self,
        }
    }
}

/// A place in a [`Line`]. Dropped, it waits for its turn and lets the next one go, also when its
/// hand-off never happened (a panic on the way), so that one failure cannot hold every later one.
#[must_use]
#[derive(Debug)]
pub struct Ticket<'a> {
    n: u64,
    line: &'a Line,
}

impl Ticket<'_> {
    /// Waits until every ticket taken before this one has been dropped.
    pub fn wait_turn(&self) {
        let mut turn = self.line.turn.lock();
        while *turn != self.n {
            self.line.passed.wait(&mut turn);
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.wait_turn();
        *self.line.turn.lock() += 1;
        self.line.passed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_offs_happen_in_the_order_their_tickets_were_taken() {
        let line = Line::default();
        let done = Mutex::new(Vec::new());
        // Tickets taken in order 0..8, their hand-offs started in reverse order.
        let taken: Vec<Ticket<'_>> = (0..8).map(|_| line.ticket()).collect();
        std::thread::scope(|s| {
            for (i, t) in taken.into_iter().enumerate().rev() {
                let done = &done;
                s.spawn(move || {
                    t.wait_turn();
                    done.lock().push(i);
                });
            }
        });
        assert_eq!(done.into_inner(), (0..8).collect::<Vec<usize>>());
    }

    #[test]
    fn a_ticket_dropped_without_its_hand_off_lets_the_next_go() {
        let line = Line::default();
        let first = line.ticket();
        let second = line.ticket();
        drop(first);
        second.wait_turn();
    }
}

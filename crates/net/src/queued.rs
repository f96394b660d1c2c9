//! What waits in the kernel's queues of a stage's sockets: bytes written and not yet taken by
//! the network (a sender's send queue) and bytes arrived and not yet read (a receiver's). Their
//! ends tell a slow network from a slow reader: a full send queue with an empty receive queue
//! on the other side is a link that carries less than both ends can move.
//!
//! Sampled by each connection at the start of its turn, once after each time the live view
//! read the totals (every 0.5 s from the run control): one `ioctl` per link per view, off the
//! data path's per-fragment work, and none while nobody looks. Sampled on a clock instead
//! (every 50 ms per link, before session 27), the ioctls were 1.3 % of all CPU at 16 readout
//! units x 60 builders, where 1 920 links take turns: a cost per connection, not per byte.
//! A view shows what the links sampled after the view before it.

use parking_lot::Mutex;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// Which of a socket's kernel queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// Arrived, not yet read (`FIONREAD`).
    Unread,
    /// Written, not yet acknowledged by the peer (`TIOCOUTQ`, that is `SIOCOUTQ` for TCP).
    Unsent,
}

/// Bytes in `fd`'s queue on `side` now; `None` when the kernel does not say (not a socket, or
/// closed).
pub fn queued(fd: RawFd, side: Side) -> Option<u64> {
    let mut n: libc::c_int = 0;
    let req = match side {
        Side::Unread => libc::FIONREAD,
        Side::Unsent => libc::TIOCOUTQ,
    };
    // SAFETY: both requests write one int through the pointer, which lives for the call.
    let r = unsafe { libc::ioctl(fd, req, &mut n as *mut libc::c_int) };
    (r == 0 && n >= 0).then_some(n as u64)
}

/// The queues of a stage's links, summed when the live view is taken. A gauge that is dropped
/// (its link ended) counts nothing, and its place is reused: as many entries as links open.
#[derive(Debug, Default)]
pub struct QueueGauges {
    cells: Mutex<Vec<Arc<AtomicU64>>>,
    /// How many times the totals were read: a link samples again when this moved.
    views: Arc<AtomicU64>,
}

impl QueueGauges {
    /// A gauge for one more link, sampling `side` of its socket.
    pub fn gauge(&self, side: Side) -> QueueGauge {
        let cell = Arc::new(AtomicU64::new(0));
        let mut v = self.cells.lock();
        v.retain(|c| Arc::strong_count(c) > 1);
        v.push(cell.clone());
        QueueGauge {
            cell,
            side,
            views: self.views.clone(),
            // A new link samples at its first turn.
            seen: u64::MAX,
        }
    }

    /// Bytes waiting in the queues of every open link, as sampled since the view before; asks
    /// every link to sample again for the next.
    pub fn total(&self) -> u64 {
        let sum = self
            .cells
            .lock()
            .iter()
            .filter(|c| Arc::strong_count(c) > 1)
            .map(|c| c.load(Relaxed))
            .sum();
        self.views.fetch_add(1, Relaxed);
        sum
    }
}

/// One link's sample of its socket's queue.
#[derive(Debug)]
pub struct QueueGauge {
    cell: Arc<AtomicU64>,
    side: Side,
    views: Arc<AtomicU64>,
    /// The view count when this link last sampled.
    seen: u64,
}

impl QueueGauge {
    /// Samples `fd`'s queue if the totals were read since the last sample.
    pub fn sample(&mut self, fd: RawFd) {
        let views = self.views.load(Relaxed);
        if views != self.seen {
            self.seen = views;
            self.cell.store(queued(fd, self.side).unwrap_or(0), Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;

    #[test]
    fn a_socket_s_queues_are_seen_from_both_ends() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        let gauges = QueueGauges::default();
        let mut g = gauges.gauge(Side::Unread);
        g.sample(b.as_raw_fd());
        assert_eq!(gauges.total(), 0);
        a.write_all(&[7u8; 1000]).unwrap();
        // Loopback delivers within the write call: the bytes are in b's receive queue.
        let mut g = gauges.gauge(Side::Unread);
        g.sample(b.as_raw_fd());
        assert_eq!(gauges.total(), 1000);
        assert_eq!(queued(a.as_raw_fd(), Side::Unsent), Some(0));
        // Sampled once per view: the view above asked for this sample, and the next bytes
        // show only after the totals were read again.
        a.write_all(&[7u8; 500]).unwrap();
        g.sample(b.as_raw_fd());
        a.write_all(&[7u8; 250]).unwrap();
        g.sample(b.as_raw_fd());
        assert_eq!(gauges.total(), 1500, "one sample per view");
        g.sample(b.as_raw_fd());
        assert_eq!(gauges.total(), 1750);
        let mut buf = [0u8; 1750];
        b.read_exact(&mut buf).unwrap();
        assert_eq!(queued(b.as_raw_fd(), Side::Unread), Some(0));
        // A dropped gauge's link counts nothing.
        drop(g);
        assert_eq!(gauges.total(), 0);
        assert_eq!(queued(-1, Side::Unread), None);
    }
}

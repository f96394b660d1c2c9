//! The headline series of every run kept in the run database: the sampler's points averaged
//! into one per second, written every few seconds (and when the run stops taking data), then
//! coarsened by the database as they age (`tessera_rundb::HISTORY_TIERS`).

use std::time::{Duration, Instant};

use tessera_rundb::{HistoryPoint, RunDb};

use crate::sampler::Point;

/// How often the points gathered are written: a run database write every few seconds, not at
/// every sample.
pub const FLUSH_EVERY: Duration = Duration::from_secs(5);
/// Points held while the database cannot take them (a full disk): past this the oldest go.
const MAX_PENDING: usize = 3_600;

#[derive(Default)]
pub struct HistoryWriter {
    /// The second being gathered: run, its start, the samples' sums.
    open: Option<(u64, u64, u32, HistoryPoint)>,
    pending: Vec<HistoryPoint>,
    last_flush: Option<Instant>,
    /// Points dropped because the database took none for an hour.
    pub dropped: u64,
}

impl HistoryWriter {
    /// Adds a sample of run `run` taken at `unix_ns`.
    pub fn add(&mut self, run: u64, unix_ns: u64, p: &Point) {
        let second = unix_ns / 1_000_000_000 * 1_000_000_000;
        if self
            .open
            .as_ref()
            .is_some_and(|o| o.0 != run || o.1 != second)
        {
            self.close();
        }
        let o = self.open.get_or_insert((
            run,
            second,
            0,
            HistoryPoint {
                run,
                unix_ns: second,
                span_s: 1.0,
                events_per_s: 0.0,
                built_bytes_per_s: 0.0,
                recorded_bytes_per_s: 0.0,
                incomplete_per_s: 0.0,
                rejected_per_s: 0.0,
                dead_time_fraction: 0.0,
                buffer_fraction: 0.0,
            },
        ));
        o.2 += 1;
        let h = &mut o.3;
        h.events_per_s += p.events_per_s;
        h.built_bytes_per_s += p.built_bytes_per_s;
        h.recorded_bytes_per_s += p.recorded_bytes_per_s;
        h.incomplete_per_s += p.incomplete_per_s;
        h.rejected_per_s += p.rejected_per_s;
        h.dead_time_fraction += p.dead_time_fraction;
        h.buffer_fraction = h.buffer_fraction.max(p.buffer_fraction);
    }

    /// Ends the second being gathered: its point is the mean of its samples.
    fn close(&mut self) {
        let Some((_, _, n, mut h)) = self.open.take() else {
            return;
        };
        let n = f64::from(n.max(1));
        h.events_per_s /= n;
        h.built_bytes_per_s /= n;
        h.recorded_bytes_per_s /= n;
        h.incomplete_per_s /= n;
        h.rejected_per_s /= n;
        h.dead_time_fraction /= n;
        if self.pending.len() >= MAX_PENDING {
            self.pending.remove(0);
            self.dropped += 1;
        }
        self.pending.push(h);
    }

    /// Writes what was gathered when [`FLUSH_EVERY`] has passed, or at once with `now`
    /// (the run stopped taking data: its last second is closed too).
    pub fn flush(&mut self, db: &RunDb, unix_ns: u64, now: bool) {
        if now {
            self.close();
        } else if self.last_flush.is_some_and(|t| t.elapsed() < FLUSH_EVERY) {
            return;
        }
        self.last_flush = Some(Instant::now());
        if self.pending.is_empty() {
            return;
        }
        match db.add_history(&self.pending, unix_ns) {
            Ok(()) => self.pending.clear(),
            // Kept for the next try: a full disk is said once per flush, not per point.
            Err(e) => {
                tracing::warn!(error = %e, points = self.pending.len(), "cannot keep the run's history yet")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(events_per_s: f64, buffer: f64) -> Point {
        Point {
            t: 0.0,
            events_per_s,
            built_bytes_per_s: 0.0,
            recorded_bytes_per_s: 0.0,
            incomplete_per_s: 0.0,
            rejected_per_s: 0.0,
            dead_time_fraction: 0.5,
            buffer_fraction: buffer,
            buffers: vec![],
        }
    }

    #[test]
    fn samples_become_one_point_per_second_written_when_the_run_stops() {
        let dir = tempfile::tempdir().unwrap();
        let db = RunDb::open(&dir.path().join("runs.db")).unwrap();
        let mut w = HistoryWriter::default();
        let s = 1_000_000_000u64;
        w.add(4, 10 * s, &p(100.0, 0.1));
        w.add(4, 10 * s + s / 2, &p(300.0, 0.9));
        w.add(4, 11 * s, &p(50.0, 0.2));
        w.flush(&db, 12 * s, false);
        let h = db.history(None, 0, u64::MAX, 10).unwrap();
        assert_eq!(h.len(), 1, "the open second is not written yet");
        assert_eq!(h[0].unix_ns, 10 * s);
        assert_eq!(h[0].events_per_s, 200.0);
        assert_eq!(h[0].buffer_fraction, 0.9);
        assert_eq!(h[0].dead_time_fraction, 0.5);
        w.add(5, 11 * s + s / 2, &p(10.0, 0.0));
        w.flush(&db, 12 * s, true);
        let h = db.history(None, 0, u64::MAX, 10).unwrap();
        assert_eq!(
            h.iter()
                .map(|x| (x.run, x.events_per_s))
                .collect::<Vec<_>>(),
            vec![(4, 200.0), (4, 50.0), (5, 10.0)]
        );
    }
}

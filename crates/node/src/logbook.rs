//! The message log: what every role and agent said, as structured lines (time, host, role,
//! level, run, message), kept in a bounded ring in each process. A `tracing` layer feeds it
//! (INFO and above, whatever the terminal's filter); an agent hands its new lines to the run
//! control with each status, and the run control keeps every host's lines in its own ring, shows
//! them (`/api/log`) and stores each run's in the run database.

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::LazyLock;
use std::time::{SystemTime, UNIX_EPOCH};

pub use tessera_node_protocol::LogLine;

/// Lines kept per process; older ones are forgotten (counted).
pub const CAPACITY: usize = 20_000;

pub struct LogBook {
    inner: Mutex<Inner>,
}

struct Inner {
    lines: VecDeque<LogLine>,
    next_seq: u64,
    forgotten: u64,
}

/// This process's message log.
pub static LOG: LazyLock<LogBook> = LazyLock::new(|| LogBook {
    inner: Mutex::new(Inner {
        lines: VecDeque::new(),
        next_seq: 1,
        forgotten: 0,
    }),
});

impl LogBook {
    /// Keeps `line`, numbered here.
    pub fn push(&self, mut line: LogLine) {
        let mut g = self.inner.lock();
        line.seq = g.next_seq;
        g.next_seq += 1;
        g.lines.push_back(line);
        if g.lines.len() > CAPACITY {
            g.lines.pop_front();
            g.forgotten += 1;
        }
    }

    /// Up to `limit` lines numbered above `after`, oldest first, and the number to ask from
    /// next.
    pub fn since(&self, after: u64, limit: usize) -> (Vec<LogLine>, u64) {
        let g = self.inner.lock();
        let v: Vec<LogLine> = g
            .lines
            .iter()
            .filter(|l| l.seq > after)
            .take(limit)
            .cloned()
            .collect();
        let next = v.last().map_or(after, |l| l.seq);
        (v, next)
    }

    /// The number of the newest line (0: none yet).
    pub fn last_seq(&self) -> u64 {
        self.inner.lock().next_seq - 1
    }

    /// Lines logged between two times (a run's), at most `limit`, oldest first.
    pub fn between(&self, from_ns: u64, to_ns: u64, limit: usize) -> Vec<LogLine> {
        let g = self.inner.lock();
        g.lines
            .iter()
            .filter(|l| l.unix_ns >= from_ns && l.unix_ns <= to_ns)
            .take(limit)
            .cloned()
            .collect()
    }

    /// Lines forgotten since the start (beyond the ring's capacity).
    pub fn forgotten(&self) -> u64 {
        self.inner.lock().forgotten
    }
}

/// The role a line comes from, by the crate that said it.
fn role_of(target: &str) -> String {
    let krate = target.split("::").next().unwrap_or(target);
    match krate {
        "tessera_readout" => "readout",
        "tessera_builder" => "builder",
        "tessera_manager" => "event_manager",
        "tessera_recorder" => "recorder",
        "tessera_monitor" => "monitor",
        "tessera_source" => "sources",
        "tessera_node" => "node",
        "tessera_control" | "tessera_run" => "run_control",
        other => other,
    }
    .to_string()
}

/// Feeds [`LOG`] from `tracing` events.
pub struct Layer;

#[derive(Default)]
struct Fields {
    message: String,
    rest: String,
    run: Option<u64>,
}

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.rest, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.rest, " {}={value}", field.name());
        }
    }

    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        if field.name() == "run" {
            self.run = Some(value);
        }
        let _ = write!(self.rest, " {}={value}", field.name());
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Layer {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let mut f = Fields::default();
        event.record(&mut f);
        let meta = event.metadata();
        // `run` written as text (`run = %n`, as the transition lines do) counts too.
        let run = f.run.or_else(|| {
            f.rest
                .split_whitespace()
                .find_map(|kv| kv.strip_prefix("run="))
                .and_then(|v| v.parse().ok())
        });
        LOG.push(LogLine {
            seq: 0,
            unix_ns: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
            host: String::new(),
            role: role_of(meta.target()),
            level: meta.level().to_string(),
            run,
            message: format!("{}{}", f.message, f.rest),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    #[test]
    fn events_become_lines_with_their_role_level_and_run() {
        let sub = tracing_subscriber::registry().with(Layer);
        let before = LOG.last_seq();
        tracing::subscriber::with_default(sub, || {
            tracing::warn!(target: "tessera_readout::serve", run = 7u64, peer = "10.0.0.1:5", "link lost");
        });
        let (lines, _) = LOG.since(before, usize::MAX);
        let l = lines
            .iter()
            .find(|l| l.message.starts_with("link lost"))
            .expect("the line is kept");
        assert_eq!(
            (l.role.as_str(), l.level.as_str(), l.run),
            ("readout", "WARN", Some(7))
        );
        assert!(l.message.contains("peer=10.0.0.1:5"), "{}", l.message);
    }

    #[test]
    fn the_ring_is_bounded() {
        let book = LogBook {
            inner: Mutex::new(Inner {
                lines: VecDeque::new(),
                next_seq: 1,
                forgotten: 0,
            }),
        };
        for i in 0..CAPACITY + 5 {
            book.push(LogLine {
                seq: 0,
                unix_ns: i as u64,
                host: String::new(),
                role: "node".into(),
                level: "INFO".into(),
                run: None,
                message: String::new(),
            });
        }
        assert_eq!(book.forgotten(), 5);
        let (v, next) = book.since(0, usize::MAX);
        assert_eq!(
            (v.len(), v[0].seq, next),
            (CAPACITY, 6, (CAPACITY + 5) as u64)
        );
    }
}

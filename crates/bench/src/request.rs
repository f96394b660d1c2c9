//! `tessera bench request`: the ATLAS ROSTester (seeds/004 §7.1) for one request-mode readout
//! unit. Emulated sources fill the unit's links as fast as it reads them; tester threads play the
//! builders and the event manager: for each event the unit announces, they send an RoI request
//! (with probability `roi_fraction`, for `roi_size` links) and a full request for the links the
//! RoI did not cover (with probability `full_fraction`), collect the answers, and clear events in
//! groups of 100. The rate at which events are cleared, with the unit and its sources saturated,
//! is the maximum sustainable clear rate of that request mix.
//!
//! Over a set of mixes, the utilisation model of the paper (eq. 7.2) is fitted by least squares:
//! `1 = f_ext·t_ext + f_int·t_int + f_clear·t_clear + S·t_kB` at saturation, with `f_ext` the
//! external request rate, `f_int` the internal transfers (fragments sent from the pages) per
//! second, `f_clear` the clear rate and `S` the kB moved per second.

use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_config::{AssignmentSection, ByteSize, SourcesSection, TriggerMode};
use tessera_format::pattern::Pattern;
use tessera_format::request::{self, Channel, Decoded, Message, Role};
use tessera_readout::{ReadoutConfig, ReadoutUnit, RequestMode};

/// One request mix to measure.
#[derive(Clone, Copy, Debug)]
pub struct Mix {
    pub fragment_size: u64,
    pub links: u32,
    pub roi_fraction: f64,
    pub roi_size: u32,
    pub full_fraction: f64,
    /// Fragments made inside the unit (the ROBIN's generator) instead of sent by emulated
    /// sources over TCP.
    pub generator: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct RequestPoint {
    /// Payload bytes per fragment.
    pub fragment_size: u64,
    /// The same in 4-byte words, as the ATLAS paper counts.
    pub fragment_words: u64,
    pub links: u32,
    pub roi_fraction: f64,
    pub roi_size: u32,
    pub full_fraction: f64,
    pub events: u64,
    /// Events cleared per second over the measured window (the unit saturated).
    pub clear_rate_hz: f64,
    pub external_requests_per_s: f64,
    pub internal_transfers_per_s: f64,
    pub kb_per_s: f64,
    /// Every request answered complete and every event cleared.
    pub clean: bool,
    /// `tcp` (emulated sources) or `generator` (fragments made inside the unit).
    pub input: &'static str,
    /// CPU seconds of the generator's thread over the whole point (0 for TCP input).
    pub generator_cpu_s: f64,
    /// CPU seconds of the unit's own threads over the whole point (its request and answer
    /// connections, event-manager link, sweeper; not the generator, not the testers or the
    /// sources). On loopback the kernel runs the receiving side's TCP processing in the
    /// sender's thread, so this carries part of the testers' receive cost.
    pub unit_cpu_s: f64,
    /// `unit_cpu_s` per event cleared, in microseconds: the clear rate one core of the unit's
    /// own would sustain is 1e6 over it.
    pub unit_cpu_us_per_clear: f64,
}

/// The fitted effective costs, in microseconds.
#[derive(Clone, Debug, Serialize)]
pub struct Fit {
    pub t_external_us: f64,
    pub t_internal_us: f64,
    pub t_clear_us: f64,
    pub t_per_kb_us: f64,
    /// 1 − predicted utilisation of each point (0 when the model is exact).
    pub residuals: Vec<f64>,
    /// Costs the non-negativity constraint holds at zero (the data would have them negative).
    pub at_zero: Vec<String>,
}

impl Fit {
    /// Predicted maximum clear rate for a mix.
    pub fn predict_hz(&self, m: &Mix) -> f64 {
        let (ext, int, kb) = per_event(m);
        let us = ext * self.t_external_us
            + int * self.t_internal_us
            + self.t_clear_us
            + kb * self.t_per_kb_us;
        if us > 0.0 {
            1e6 / us
        } else {
            f64::INFINITY
        }
    }
}

/// Expected external requests, internal transfers and kB moved per event.
fn per_event(m: &Mix) -> (f64, f64, f64) {
    let (r, f, k, l) = (
        m.roi_fraction,
        m.full_fraction,
        m.roi_size.min(m.links) as f64,
        m.links as f64,
    );
    let ext = r + f;
    // A full request asks for the links an RoI request of the same event did not.
    let int = r * k + f * (l - r * k);
    (ext, int, int * m.fragment_size as f64 / 1000.0)
}

fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn unit(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

/// The requests of one event: (tag, source IDs; empty = all).
fn requests_for(e: u64, m: &Mix) -> Vec<(u64, Vec<u32>)> {
    let h = mix64(e ^ 0x5EED);
    let mut v = Vec::new();
    let k = m.roi_size.min(m.links);
    let first = (mix64(h) % m.links as u64) as u32;
    let roi: Vec<u32> = (0..k).map(|i| (first + i) % m.links).collect();
    let with_roi = unit(h) < m.roi_fraction;
    if with_roi {
        v.push((1, roi.clone()));
    }
    if unit(mix64(h ^ 1)) < m.full_fraction {
        if with_roi {
            let rest: Vec<u32> = (0..m.links).filter(|l| !roi.contains(l)).collect();
            if !rest.is_empty() {
                v.push((2, rest));
            }
        } else {
            v.push((2, Vec::new()));
        }
    }
    v
}

const TESTERS: u32 = 2;
const CLEAR_GROUP: usize = 100;

struct Tally {
    requests: AtomicU64,
    fragments: AtomicU64,
    bytes: AtomicU64,
    partial: AtomicU64,
    cleared: AtomicU64,
    /// (events cleared, when) at the start of the measured window.
    window_start: Mutex<Option<(u64, Instant)>>,
}

/// Measures one mix: `events` events through one readout unit.
pub fn measure(m: &Mix, events: u64) -> Result<RequestPoint> {
    if m.links == 0 || m.fragment_size == 0 {
        bail!("links and fragment size must be positive");
    }
    let em_listener = TcpListener::bind("127.0.0.1:0")?;
    let em_addr = em_listener.local_addr()?.to_string();
    let ru_listener = TcpListener::bind("127.0.0.1:0")?;
    let ru_addr = ru_listener.local_addr()?.to_string();
    let max_payload = (m.fragment_size as usize).max(1024);
    let per_link: u64 = 8 << 20;
    let sources: Vec<u32> = (0..m.links).collect();
    let ru = ReadoutUnit::start(ReadoutConfig {
        id: 0,
        listener: ru_listener,
        sources: sources.clone(),
        builders: Vec::new(),
        assignment: AssignmentSection::default(),
        buffer: per_link * m.links as u64,
        read_chunk: 256 << 10,
        reserve: true,
        event_timeout: Duration::from_secs(5),
        max_open_events: 1 << 16,
        max_payload,
        dial: Vec::new(),
        quarantine: None,
        request_mode: Some(RequestMode {
            page_size: 4096,
            descriptors: 1024,
            timeout: Duration::from_secs(10),
            event_manager: em_addr,
            builders: (0..TESTERS).collect(),
            takeover: Duration::ZERO,
            generator: m.generator.then_some(tessera_readout::LinkGenerator {
                payload_size: m.fragment_size as usize,
                events,
            }),
        }),
    })
    .context("starting the readout unit")?;
    let (mut em, _) = em_listener.accept()?;
    let mut hello = [0u8; 24];
    em.read_exact(&mut hello)?;
    let em_w = Arc::new(Mutex::new(em.try_clone()?));
    let tally = Arc::new(Tally {
        requests: AtomicU64::new(0),
        fragments: AtomicU64::new(0),
        bytes: AtomicU64::new(0),
        partial: AtomicU64::new(0),
        cleared: AtomicU64::new(0),
        window_start: Mutex::new(None),
    });
    let warmup = events / 10;
    // Testers: event IDs are dealt by event ID modulo the tester count.
    let mut feeds = Vec::new();
    let mut testers = Vec::new();
    let (clear_tx, clear_rx) = crossbeam_channel::bounded::<u64>(1 << 16);
    for t in 0..TESTERS {
        let (tx, rx) = crossbeam_channel::bounded::<u64>(1 << 16);
        feeds.push(tx);
        let addr = ru_addr.clone();
        let mix = *m;
        let tl = tally.clone();
        let ctx = clear_tx.clone();
        testers.push(std::thread::spawn(move || {
            tester(t, &addr, &mix, rx, ctx, &tl)
        }));
    }
    drop(clear_tx);
    // Clears, in groups.
    let clearer = {
        let tl = tally.clone();
        let w = em_w.clone();
        std::thread::spawn(move || {
            let mut group = Vec::with_capacity(CLEAR_GROUP);
            let mut last = Instant::now();
            loop {
                match clear_rx.recv_timeout(Duration::from_millis(20)) {
                    Ok(e) => group.push(e),
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
                }
                if group.len() >= CLEAR_GROUP
                    || (!group.is_empty() && last.elapsed() > Duration::from_millis(50))
                {
                    let n = group.len() as u64;
                    let m = Message::Clear {
                        event_ids: std::mem::take(&mut group),
                    };
                    if w.lock().unwrap().write_all(&m.encode()).is_err() {
                        break;
                    }
                    let done = tl.cleared.fetch_add(n, Ordering::Relaxed) + n;
                    let mut ws = tl.window_start.lock().unwrap();
                    if ws.is_none() && done >= warmup {
                        *ws = Some((done, Instant::now()));
                    }
                    last = Instant::now();
                }
            }
            if !group.is_empty() {
                let n = group.len() as u64;
                let _ = w
                    .lock()
                    .unwrap()
                    .write_all(&Message::Clear { event_ids: group }.encode());
                tl.cleared.fetch_add(n, Ordering::Relaxed);
            }
        })
    };
    let src = if m.generator {
        None
    } else {
        Some(
            tessera_source::start(tessera_source::SourcePlan {
                settings: SourcesSection {
                    count: m.links,
                    fragment_size: ByteSize(m.fragment_size),
                    trigger: TriggerMode::Unlimited,
                    ..Default::default()
                },
                pattern: Pattern::Counter,
                max_payload,
                sources: sources.iter().map(|&s| (s, ru_addr.clone())).collect(),
                injections: Vec::new(),
                events,
                start_held: false,
                veto: false,
                scenario: None,
                size_histogram: None,
                listening: Vec::new(),
                unit_of: Default::default(),
                replay: None,
            })
            .context("starting the sources")?,
        )
    };
    // The event manager's side: announcements in, dealt to the testers.
    let mut announced = 0u64;
    let mut rd = Reader::default();
    em.set_read_timeout(Some(Duration::from_secs(30)))?;
    while announced < events {
        match rd.next(&mut em) {
            Some(Message::Announce { event_ids }) => {
                for e in event_ids {
                    announced += 1;
                    let _ = feeds[(e % TESTERS as u64) as usize].send(e);
                }
            }
            Some(Message::End { .. }) => break,
            Some(_) => {}
            None => bail!("the readout unit stopped announcing after {announced} events"),
        }
    }
    drop(feeds);
    let mut clean = announced == events;
    for t in testers {
        clean &= t.join().map_err(|_| anyhow::anyhow!("tester panicked"))?;
    }
    clearer
        .join()
        .map_err(|_| anyhow::anyhow!("clearer panicked"))?;
    let end = Instant::now();
    // Read while the unit's threads live: an ended thread takes its time with it.
    let unit_cpu_s =
        tessera_net::role::threads_cpu_ns(|n| n.starts_with("ru0-") && n != "ru0-generator") as f64
            / 1e9;
    let cleared = tally.cleared.load(Ordering::Relaxed);
    let _ = em_w
        .lock()
        .unwrap()
        .write_all(&Message::End { units: 0, items: 0 }.encode());
    if let Some(s) = &src {
        s.stop();
    }
    ru.stop();
    let t0 = Instant::now();
    while !ru.is_finished() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    clean &= ru.stats.requests.stored_fragments.load(Ordering::Relaxed) == 0
        && cleared == events
        && tally.partial.load(Ordering::Relaxed) == 0;
    let generator_cpu_s = ru.stats.requests.generator_cpu_ns.load(Ordering::Relaxed) as f64 / 1e9;
    ru.abort();
    if let Some(s) = src {
        s.join();
    }
    let (c0, t_start) = tally.window_start.lock().unwrap().unwrap_or((0, end));
    let dt = (end - t_start).as_secs_f64().max(1e-9);
    let frac = (cleared - c0) as f64 / cleared.max(1) as f64;
    // Requests and transfers are spread evenly over events: scale the totals to the window.
    let rate = |total: u64| total as f64 * frac / dt;
    Ok(RequestPoint {
        fragment_size: m.fragment_size,
        fragment_words: m.fragment_size / 4,
        links: m.links,
        roi_fraction: m.roi_fraction,
        roi_size: m.roi_size,
        full_fraction: m.full_fraction,
        events,
        clear_rate_hz: (cleared - c0) as f64 / dt,
        external_requests_per_s: rate(tally.requests.load(Ordering::Relaxed)),
        internal_transfers_per_s: rate(tally.fragments.load(Ordering::Relaxed)),
        kb_per_s: rate(tally.bytes.load(Ordering::Relaxed)) / 1000.0,
        clean,
        input: if m.generator { "generator" } else { "tcp" },
        generator_cpu_s,
        unit_cpu_s,
        unit_cpu_us_per_clear: unit_cpu_s * 1e6 / cleared.max(1) as f64,
    })
}

/// One tester: sends every request of its events as they come (at most `WINDOW` events in
/// flight), reads answers on its data connection, passes finished events to the clearer.
fn tester(
    id: u32,
    addr: &str,
    m: &Mix,
    events: crossbeam_channel::Receiver<u64>,
    clears: crossbeam_channel::Sender<u64>,
    tl: &Tally,
) -> bool {
    const WINDOW: usize = 256;
    let open = |c| -> std::io::Result<TcpStream> {
        let mut s = TcpStream::connect(addr)?;
        s.set_nodelay(c == Channel::Control)?;
        s.write_all(
            &Message::Hello {
                role: Role::BuilderUnit,
                channel: c,
                id,
            }
            .encode(),
        )?;
        Ok(s)
    };
    let (Ok(mut control), Ok(mut data)) = (open(Channel::Control), open(Channel::Data)) else {
        return false;
    };
    let _ = data.set_read_timeout(Some(Duration::from_secs(30)));
    let mut waiting: std::collections::HashMap<u64, usize> = Default::default();
    let mut rd = Reader::default();
    let mut out = Vec::new();
    let mut ok = true;
    let mut open_feed = true;
    loop {
        // Take events while the window has room, then read answers.
        out.clear();
        while open_feed && waiting.len() < WINDOW {
            let next = if waiting.is_empty() {
                events.recv().ok()
            } else {
                match events.try_recv() {
                    Ok(e) => Some(e),
                    Err(crossbeam_channel::TryRecvError::Empty) => break,
                    Err(crossbeam_channel::TryRecvError::Disconnected) => None,
                }
            };
            let Some(e) = next else {
                open_feed = false;
                break;
            };
            let reqs = requests_for(e, m);
            if reqs.is_empty() {
                let _ = clears.send(e);
                continue;
            }
            waiting.insert(e, reqs.len());
            tl.requests.fetch_add(reqs.len() as u64, Ordering::Relaxed);
            for (tag, sources) in reqs {
                Message::Request {
                    tag,
                    event_id: e,
                    sources,
                }
                .encode_into(&mut out);
            }
        }
        if !out.is_empty() && control.write_all(&out).is_err() {
            return false;
        }
        if waiting.is_empty() {
            if !open_feed {
                break;
            }
            continue;
        }
        match rd.next(&mut data) {
            Some(Message::Answer(h)) => {
                tl.fragments
                    .fetch_add(h.fragment_count as u64, Ordering::Relaxed);
                tl.bytes.fetch_add(
                    (h.total_size as usize - h.header_size()) as u64,
                    Ordering::Relaxed,
                );
                if !h.missing.is_empty() {
                    tl.partial.fetch_add(1, Ordering::Relaxed);
                    ok = false;
                }
                if let Some(n) = waiting.get_mut(&h.event_id) {
                    *n -= 1;
                    if *n == 0 {
                        waiting.remove(&h.event_id);
                        let _ = clears.send(h.event_id);
                    }
                }
            }
            _ => return false,
        }
    }
    let _ = control.write_all(&Message::End { units: 0, items: 0 }.encode());
    ok
}

/// The testers' and the event manager's message reader. It plays machines that are not this
/// one (the ATLAS ROSTester ran on two other servers), so it must take as little of the two
/// cores as it can: one buffer, zeroed once, read into where the last read ended, its unread
/// bytes moved to the front only when the room behind them is short. (It zeroed 256 KiB and
/// moved its unread bytes before every read: 38 % of the instructions of a generator-fed point
/// under callgrind went to that zeroing.)
#[derive(Default)]
struct Reader {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl Reader {
    const READ: usize = 256 << 10;

    fn next(&mut self, s: &mut TcpStream) -> Option<Message> {
        loop {
            let need = match request::decode(&self.buf[self.start..self.end], 1 << 28) {
                Ok(Decoded::Message(m, n)) => {
                    self.start += n;
                    return Some(m);
                }
                Ok(Decoded::NeedMore(n)) => n,
                Err(_) => return None,
            };
            let room = Self::READ.max(need);
            if self.buf.len() - self.start < room || self.buf.len() - self.end < Self::READ / 4 {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
                if self.buf.len() < room + Self::READ {
                    self.buf.resize(room + Self::READ, 0);
                }
            }
            match s.read(&mut self.buf[self.end..]) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.end += n,
            }
        }
    }
}

/// Least-squares fit of eq. 7.2 over the points (each at 100 % utilisation), every cost
/// constrained to be non-negative: a cost below zero has no meaning (the unconstrained fit gave
/// a negative cost per kB on this host, the per-transfer and per-kB terms being nearly collinear
/// over 300 to 450 words). With four costs the exact non-negative least-squares solution is
/// found by trying every subset of costs free (the rest held at zero) and keeping the best
/// feasible one.
pub fn fit(points: &[RequestPoint]) -> Option<Fit> {
    // The model's costs are those of input over TCP: generated input is another machine.
    let points: Vec<&RequestPoint> = points.iter().filter(|p| p.input == "tcp").collect();
    if points.len() < 4 {
        return None;
    }
    let rows = model_rows(points.iter().copied());
    let sse = |t: &[f64; 4]| -> f64 {
        rows.iter()
            .map(|r| (1.0 - (0..4).map(|i| r[i] * t[i]).sum::<f64>()).powi(2))
            .sum()
    };
    let mut best: Option<([f64; 4], f64, u8)> = None;
    for free in 1u8..16 {
        let Some(t) = least_squares(&rows, free) else {
            continue;
        };
        if t.iter().any(|&x| x < 0.0) {
            continue;
        }
        let e = sse(&t);
        // Ties (the same error) go to the fit with more costs free.
        let better = best.as_ref().is_none_or(|(_, be, bf)| {
            e < *be - 1e-15 || ((e - *be).abs() <= 1e-15 && free.count_ones() > bf.count_ones())
        });
        if better {
            best = Some((t, e, free));
        }
    }
    let (t, _, free) = best?;
    let residuals = rows
        .iter()
        .map(|r| 1.0 - (0..4).map(|i| r[i] * t[i]).sum::<f64>())
        .collect();
    let names = ["external request", "internal transfer", "clear", "kB"];
    Some(Fit {
        t_external_us: t[0],
        t_internal_us: t[1],
        t_clear_us: t[2],
        t_per_kb_us: t[3],
        residuals,
        at_zero: (0..4)
            .filter(|i| free & (1 << i) == 0)
            .map(|i| names[i].to_string())
            .collect(),
    })
}

/// The model's rows [f_ext, f_int, f_clear, S] of each point, in units that keep the normal
/// equations well scaled (per microsecond); each row's target is 1 (100 % utilisation).
fn model_rows<'a>(points: impl Iterator<Item = &'a RequestPoint>) -> Vec<[f64; 4]> {
    points
        .map(|p| {
            [
                p.external_requests_per_s / 1e6,
                p.internal_transfers_per_s / 1e6,
                p.clear_rate_hz / 1e6,
                p.kb_per_s / 1e6,
            ]
        })
        .collect()
}

/// Unconstrained least squares of `rows · t = 1` over the costs in `free` (bit i: cost i), the
/// others zero; `None` when the normal equations are singular.
fn least_squares(rows: &[[f64; 4]], free: u8) -> Option<[f64; 4]> {
    let idx: Vec<usize> = (0..4).filter(|i| free & (1 << i) != 0).collect();
    let n = idx.len();
    let mut a = vec![vec![0.0f64; n + 1]; n];
    for r in rows {
        for (i, &ii) in idx.iter().enumerate() {
            for (j, &jj) in idx.iter().enumerate() {
                a[i][j] += r[ii] * r[jj];
            }
            a[i][n] += r[ii];
        }
    }
    // Gaussian elimination with partial pivoting.
    for c in 0..n {
        let p = (c..n).max_by(|&x, &y| a[x][c].abs().total_cmp(&a[y][c].abs()))?;
        if a[p][c].abs() < 1e-300 {
            return None;
        }
        a.swap(c, p);
        let pivot = a[c].clone();
        for (r, row) in a.iter_mut().enumerate() {
            if r != c {
                let f = row[c] / pivot[c];
                for (x, p) in row.iter_mut().zip(pivot.iter()).skip(c) {
                    *x -= f * p;
                }
            }
        }
    }
    let mut t = [0.0f64; 4];
    for (i, &ii) in idx.iter().enumerate() {
        t[ii] = a[i][n] / a[i][i];
        if !t[ii].is_finite() {
            return None;
        }
    }
    Some(t)
}

/// The mixes measured: the paper's Figure 9 (300 to 450 words, RoI size 4, full-build fraction
/// 20 to 50 %, here with a 10 % RoI fraction), a mix with many RoI requests so that their cost
/// separates from the rest, and the design point (24 links of 400 words, full build 100 %).
pub fn plan(quick: bool, links: u32) -> Vec<Mix> {
    let words: &[u64] = if quick {
        &[300, 450]
    } else {
        &[300, 350, 400, 450]
    };
    let fulls: &[f64] = if quick {
        &[0.2, 0.5]
    } else {
        &[0.2, 0.35, 0.5]
    };
    let mut v = Vec::new();
    for &w in words {
        for &f in fulls {
            v.push(Mix {
                fragment_size: 4 * w,
                links,
                roi_fraction: 0.1,
                roi_size: 4,
                full_fraction: f,
                generator: false,
            });
        }
    }
    v.push(Mix {
        fragment_size: 1600,
        links,
        roi_fraction: 0.6,
        roi_size: 4,
        full_fraction: 0.1,
        generator: false,
    });
    v.push(Mix {
        fragment_size: 1600,
        links,
        roi_fraction: 0.0,
        roi_size: 4,
        full_fraction: 1.0,
        generator: false,
    });
    // The design point again, fed by the in-process generator (as the ATLAS lab measured).
    v.push(Mix {
        fragment_size: 1600,
        links,
        roi_fraction: 0.0,
        roi_size: 4,
        full_fraction: 1.0,
        generator: true,
    });
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The points of `mixes` as if each were measured at 100 % utilisation with `us`
    /// microseconds per event (from the mix's index, the mix, and its requests, transfers and
    /// kB per event).
    fn points_at_full_load(
        mixes: &[Mix],
        us: impl Fn(usize, &Mix, f64, f64, f64) -> f64,
    ) -> Vec<RequestPoint> {
        mixes
            .iter()
            .enumerate()
            .map(|(k, m)| {
                let (ext, int, kb) = per_event(m);
                let hz = 1e6 / us(k, m, ext, int, kb);
                RequestPoint {
                    fragment_size: m.fragment_size,
                    fragment_words: m.fragment_size / 4,
                    links: m.links,
                    roi_fraction: m.roi_fraction,
                    roi_size: m.roi_size,
                    full_fraction: m.full_fraction,
                    events: 0,
                    clear_rate_hz: hz,
                    external_requests_per_s: ext * hz,
                    internal_transfers_per_s: int * hz,
                    kb_per_s: kb * hz,
                    clean: true,
                    input: "tcp",
                    generator_cpu_s: 0.0,
                    unit_cpu_s: 0.0,
                    unit_cpu_us_per_clear: 0.0,
                }
            })
            .collect()
    }

    #[test]
    fn the_fit_recovers_known_costs() {
        // Points generated from known costs at 100 % utilisation.
        let t = [2.0, 0.5, 3.0, 0.8];
        let mixes = plan(false, 24);
        let pts = points_at_full_load(&mixes, |_, _, ext, int, kb| {
            ext * t[0] + int * t[1] + t[2] + kb * t[3]
        });
        let f = fit(&pts).unwrap();
        for (got, want) in [
            (f.t_external_us, t[0]),
            (f.t_internal_us, t[1]),
            (f.t_clear_us, t[2]),
            (f.t_per_kb_us, t[3]),
        ] {
            assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        }
        assert!(f.residuals.iter().all(|r| r.abs() < 1e-9));
        let m = &mixes[0];
        assert!((f.predict_hz(m) - pts[0].clear_rate_hz).abs() < 1e-3);
    }

    /// Points whose unconstrained fit has a negative cost: the constrained fit holds it at zero,
    /// names it, and keeps the others non-negative.
    #[test]
    fn the_fit_never_gives_a_negative_cost() {
        let t = [2.0, 0.5, 3.0, 0.0];
        let mixes = plan(false, 24);
        let pts = points_at_full_load(&mixes, |k, m, ext, int, _| {
            // Bigger fragments a little faster than the model: a negative per-kB cost
            // fits best without the constraint.
            (ext * t[0] + int * t[1] + t[2]) * (1.0 - 0.02 * (m.fragment_size as f64 / 1600.0))
                + 0.001 * (k % 3) as f64
        });
        let free = least_squares(&model_rows(pts.iter()), 15).unwrap();
        assert!(
            free.iter().any(|&x| x < 0.0),
            "the case must need the constraint: {free:?}"
        );
        let f = fit(&pts).unwrap();
        for c in [
            f.t_external_us,
            f.t_internal_us,
            f.t_clear_us,
            f.t_per_kb_us,
        ] {
            assert!(c >= 0.0, "{f:?}");
        }
        assert!(!f.at_zero.is_empty(), "{f:?}");
        assert!(f.residuals.iter().all(|r| r.abs() < 0.05), "{f:?}");
    }

    #[test]
    fn requests_cover_each_link_at_most_once_per_event() {
        let m = Mix {
            fragment_size: 1600,
            links: 24,
            roi_fraction: 0.5,
            roi_size: 4,
            full_fraction: 0.5,
            generator: false,
        };
        let (mut ext, mut int) = (0usize, 0usize);
        for e in 0..20_000u64 {
            let r = requests_for(e, &m);
            let mut links: Vec<u32> = r
                .iter()
                .flat_map(|(_, s)| {
                    if s.is_empty() {
                        (0..24).collect()
                    } else {
                        s.clone()
                    }
                })
                .collect();
            ext += r.len();
            int += links.len();
            links.sort_unstable();
            let n = links.len();
            links.dedup();
            assert_eq!(n, links.len(), "event {e} asks a link twice");
        }
        let (pe, pi, _) = per_event(&m);
        assert!((ext as f64 / 20_000.0 - pe).abs() < 0.03);
        assert!((int as f64 / 20_000.0 - pi).abs() < 0.3);
    }
}

//! `tessera bench trapezoid`: building per CPU-second as the number of connections grows, the
//! CMS trapezoid (seeds/001: throughput flat in the number of readout and builder units). Each
//! shape is readout units x builders, every unit connected to every builder (units x builders
//! connections), two emulated sources of 16 KiB per unit, unlimited trigger, builders counting
//! and dropping (no recorder), in one process; each builder has 1 MiB of buffer per readout unit
//! (read chunks of 256 KiB), each unit 8 MiB.
//!
//! The figure is event bytes built per CPU-second of the whole process (getrusage: every
//! thread, sources included), and the same without the sources' threads, over the run's steady
//! part: while the sources send their second half but the last twentieth, the buffers full.
//! Why not the whole run: its start connects every link and touches every buffer page for the
//! first time (at 16 x 60, 960 links x 1 MiB: a gigabyte of page faults, a one-off cost that
//! would be much of a short run), and its end drains the buffers with the sources idle. Each shape's figure is given against the first shape's, measured in the same
//! invocation. The process's peak thread count and descriptors are sampled while it runs.

use anyhow::{Context, Result};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_config::Topology;
use tessera_run::{Options, StatusMode};

use crate::{cpu_seconds, BenchArgs};

#[derive(Debug, Serialize)]
pub struct Shape {
    pub readout_units: usize,
    pub builders: usize,
    pub connections: usize,
    pub fragment_size: u64,
    pub events: u64,
    pub clean: bool,
    pub wall_s: f64,
    pub cpu_s: f64,
    pub sources_cpu_s: f64,
    pub built_mb_per_s: f64,
    /// Event bytes built per CPU-second of the whole process, in MB.
    pub mb_per_cpu_s: f64,
    /// The same without the emulated sources' threads.
    pub daq_mb_per_cpu_s: f64,
    /// Against the first shape of the same invocation.
    pub ratio: f64,
    pub daq_ratio: f64,
    /// The whole run, start (connections, first touch of every buffer page) and drain
    /// included: event bytes built per CPU-second, and against the first shape's.
    pub whole_run_mb_per_cpu_s: f64,
    pub whole_run_ratio: f64,
    pub peak_threads: usize,
    pub peak_descriptors: usize,
}

fn threads_now() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

fn descriptors_now() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

fn topology(rus: usize, bus: usize, size: u64, events: u64) -> String {
    let per = 2;
    let mut t = format!(
        "[run]\nevents = {events}\nmax_fragment_size = \"64 KiB\"\n[sources]\ncount = {}\nfragment_size = {size}\ntrigger = \"unlimited\"\n\
         [recorder]\nenabled = false\n[monitor]\nenabled = false\n",
        rus * per
    );
    for r in 0..rus {
        t += &format!(
            "[[readout]]\nid = {r}\nsources = \"{}-{}\"\nbuffer = \"8 MiB\"\n",
            per * r,
            per * r + per - 1
        );
    }
    for b in 0..bus {
        t += &format!(
            "[[builder]]\nid = {b}\nbuffer = \"{} MiB\"\nread_chunk = \"256 KiB\"\n",
            rus
        );
    }
    t
}

/// CPU seconds of the emulated sources' driver threads so far (they still run).
fn sources_cpu_now() -> f64 {
    tessera_net::role::threads_cpu_ns(|n| n.starts_with("source-drv")) as f64 / 1e9
}

/// CPU (all, sources), wall time and bytes built at one moment.
#[derive(Clone, Copy)]
struct Mark {
    cpu: f64,
    sources: f64,
    t: Instant,
    built: u64,
}

fn shape(rus: usize, bus: usize, size: u64, bytes: f64) -> Result<Shape> {
    let event_bytes = (rus * 2) as f64 * size as f64;
    let events = ((bytes / event_bytes) as u64).max(2 * bus as u64);
    let name = format!("trapezoid-{rus}x{bus}");
    let topo = Topology::parse(&topology(rus, bus, size, events), &name)?;
    let opts = Options {
        status: StatusMode::Off,
        manifest: false,
        ..Default::default()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (pt, pd) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let sampler = {
        let (stop, pt, pd) = (stop.clone(), pt.clone(), pd.clone());
        std::thread::spawn(move || {
            // Threads every 50 ms (a peak may be brief: links connecting); descriptors, which
            // stay once the links are up, every 0.5 s, since listing 2 000 of them 20 times a
            // second was a cost of the bench's own that only the large shapes paid.
            let mut turn = 0u32;
            while !stop.load(Ordering::Relaxed) {
                pt.fetch_max(threads_now(), Ordering::Relaxed);
                if turn.is_multiple_of(10) {
                    pd.fetch_max(descriptors_now(), Ordering::Relaxed);
                }
                turn = turn.wrapping_add(1);
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let cpu0 = cpu_seconds();
    let result = (|| -> Result<(tessera_run::Report, Mark, Mark)> {
        let session = tessera_run::Session::start(&topo, &opts)
            .with_context(|| format!("the {name} point"))?;
        let mark = |built: u64| Mark {
            cpu: cpu_seconds(),
            sources: sources_cpu_now(),
            t: Instant::now(),
            built,
        };
        let (mut from, mut to) = (None, None);
        let fragments = events * (rus as u64) * 2;
        let reason = loop {
            std::thread::sleep(Duration::from_millis(20));
            if let Some(r) = session.end_reason() {
                break r;
            }
            // Not the whole live view: built 50 times a second over 76 roles, it was a cost of
            // the bench's own that grew with the shape.
            let (sent, built) = session.sent_and_built();
            if from.is_none() && sent >= fragments / 2 {
                from = Some(mark(built));
            }
            if to.is_none() && sent >= fragments * 19 / 20 {
                to = Some(mark(built));
            }
        };
        let stopped = session.stop(&tessera_run::StopDeadlines::from(&topo.topology.stop));
        let rep = session.finish(reason, stopped)?;
        match (from, to) {
            (Some(a), Some(b)) if b.built > a.built => Ok((rep, a, b)),
            _ => anyhow::bail!(
                "the {name} point ended before its steady part could be measured (increase --bytes)"
            ),
        }
    })();
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    let (rep, a, b) = result?;
    let whole_cpu = cpu_seconds() - cpu0;
    let (cpu_s, wall_s) = (b.cpu - a.cpu, (b.t - a.t).as_secs_f64());
    let sources_cpu_s = b.sources - a.sources;
    let built = (b.built - a.built) as f64 / 1e6;
    Ok(Shape {
        readout_units: rus,
        builders: bus,
        connections: rus * bus,
        fragment_size: size,
        events: rep.events_complete + rep.events_incomplete,
        clean: rep.ok() && rep.events_incomplete == 0,
        wall_s,
        cpu_s,
        sources_cpu_s,
        built_mb_per_s: built / wall_s.max(1e-9),
        mb_per_cpu_s: built / cpu_s.max(1e-9),
        daq_mb_per_cpu_s: built / (cpu_s - sources_cpu_s).max(1e-9),
        ratio: 1.0,
        daq_ratio: 1.0,
        whole_run_mb_per_cpu_s: rep.bytes_built as f64 / 1e6 / whole_cpu.max(1e-9),
        whole_run_ratio: 1.0,
        peak_threads: pt.load(Ordering::Relaxed),
        peak_descriptors: pd.load(Ordering::Relaxed),
    })
}

pub fn run_trapezoid(a: &BenchArgs) -> Result<()> {
    let shapes: &[(usize, usize)] = if a.quick {
        &[(8, 2), (16, 60)]
    } else {
        &[(8, 2), (8, 16), (8, 60), (16, 60)]
    };
    let size = a
        .sizes
        .as_ref()
        .and_then(|s| s.first().copied())
        .unwrap_or(16384);
    let bytes = a.bytes.unwrap_or(if a.quick { 3e9 } else { 6e9 });
    if !a.json {
        eprintln!(
            "trapezoid: readout units x builders, 2 sources of {size} B per unit, builders counting and dropping, {:.1} GB per shape (measured while the sources send from 50 to 95 %) (machine: {} cores, {} I/O pollers)",
            bytes / 1e9,
            std::thread::available_parallelism().map_or(1, |n| n.get()),
            tessera_net::reactor::Reactor::stage(tessera_net::reactor::Stage::Readout).threads()
        );
        println!(
            "{:>5} {:>5} {:>6} {:>9} {:>9} {:>10} {:>12} {:>7} {:>10} {:>12} {:>8} {:>8} {:>5}",
            "RUs",
            "BUs",
            "conns",
            "events",
            "MB/s",
            "MB/CPU-s",
            "DAQ MB/CPU-s",
            "ratio",
            "DAQ ratio",
            "whole run",
            "threads",
            "fds",
            "clean"
        );
    }
    let mut first: Option<(f64, f64, f64)> = None;
    for &(rus, bus) in shapes {
        let mut s = shape(rus, bus, size, bytes)?;
        let (f, fd, fw) =
            *first.get_or_insert((s.mb_per_cpu_s, s.daq_mb_per_cpu_s, s.whole_run_mb_per_cpu_s));
        s.ratio = s.mb_per_cpu_s / f.max(1e-9);
        s.daq_ratio = s.daq_mb_per_cpu_s / fd.max(1e-9);
        s.whole_run_ratio = s.whole_run_mb_per_cpu_s / fw.max(1e-9);
        if a.json {
            println!("{}", serde_json::to_string(&s)?);
        } else {
            println!(
                "{:>5} {:>5} {:>6} {:>9} {:>9.0} {:>10.0} {:>12.0} {:>7.2} {:>10.2} {:>12.2} {:>8} {:>8} {:>5}",
                s.readout_units,
                s.builders,
                s.connections,
                s.events,
                s.built_mb_per_s,
                s.mb_per_cpu_s,
                s.daq_mb_per_cpu_s,
                s.ratio,
                s.daq_ratio,
                s.whole_run_ratio,
                s.peak_threads,
                s.peak_descriptors,
                if s.clean { "yes" } else { "NO" }
            );
        }
    }
    Ok(())
}

//! `tessera bench lowrate`: what a DAQ idling at a low trigger rate costs. The COMET SUPPRESS
//! setup (105 sources of ~380 B on 5 readout units, 1 builder, the recorder writing) runs at a
//! periodic 1 kHz and again at saturation (unlimited trigger); the process's CPU time (user and
//! system, every thread, from getrusage) per fragment at 1 kHz over the same at saturation is the
//! figure (issue 14's target: at most 1.5). A DAQ that costs far more per fragment when little
//! flows spends its CPU on wake-ups, not on data.

use anyhow::Result;
use serde::Serialize;

use tessera_config::Topology;

use crate::BenchArgs;

#[derive(Debug, Serialize)]
pub struct LowRatePoint {
    pub trigger: String,
    pub events: u64,
    pub fragments: u64,
    pub wall_s: f64,
    pub cpu_s: f64,
    /// CPU seconds per wall second (2.0 = both cores of this machine).
    pub cores_used: f64,
    pub cpu_ns_per_fragment: f64,
    /// CPU of the emulated sources' driver threads (stand-ins for front-end hardware).
    pub sources_cpu_s: f64,
    /// CPU per fragment without the sources' threads: what the DAQ itself costs. On loopback
    /// part of the receive path (the kernel's softirq) runs in the sending thread, so this
    /// still leaves some receive cost with the sources.
    pub daq_cpu_ns_per_fragment: f64,
}

#[derive(Debug, Serialize)]
pub struct LowRate {
    pub low: LowRatePoint,
    pub saturated: LowRatePoint,
    /// CPU per fragment at 1 kHz over the same at saturation.
    pub ratio: f64,
    /// The same ratio for the DAQ's own threads.
    pub daq_ratio: f64,
}

/// `run` and `trigger`: the keys of `[run]` (events or duration) and the trigger's in `[sources]`.
fn topology(run: &str, trigger: &str) -> String {
    let mut t = format!(
        "[run]\n{run}\nmax_fragment_size = \"4 KiB\"\n[sources]\ncount = 105\nfragment_size = 380\n{trigger}\n\
         [[builder]]\nid = 0\n[recorder]\nfsync = false\nmax_file_size = \"256 MiB\"\n\
         [monitor]\nenabled = false\n"
    );
    for ru in 0..5 {
        t += &format!(
            "[[readout]]\nid = {ru}\nsources = \"{}-{}\"\n",
            21 * ru,
            21 * ru + 20
        );
    }
    t
}

fn point(name: &str, run: &str, trigger: &str, dir: &std::path::Path) -> Result<LowRatePoint> {
    let r = Topology::parse(&topology(run, trigger), name)?;
    let crate::Measured {
        report: rep,
        cpu_s,
        sources_cpu_s,
        wall_s,
    } = crate::run_measured(&r, &dir.join(name), name)?;
    let events = rep.events_complete + rep.events_incomplete;
    let fragments = rep.balance.sent;
    Ok(LowRatePoint {
        trigger: name.into(),
        events,
        fragments,
        wall_s,
        cpu_s,
        cores_used: cpu_s / wall_s.max(1e-9),
        cpu_ns_per_fragment: cpu_s * 1e9 / fragments.max(1) as f64,
        sources_cpu_s,
        daq_cpu_ns_per_fragment: (cpu_s - sources_cpu_s).max(0.0) * 1e9 / fragments.max(1) as f64,
    })
}

pub fn run_lowrate(a: &BenchArgs) -> Result<()> {
    let secs = if a.quick { 2 } else { 6 };
    let dir = tempfile::tempdir()?;
    if !a.json {
        eprintln!(
            "low rate: COMET SUPPRESS (105 sources x 380 B, 5 readout units, 1 builder, recorder) at 1 kHz for {secs} s and at saturation"
        );
    }
    let low = point(
        "periodic-1kHz",
        &format!("duration_s = {secs}"),
        "trigger = \"periodic\"\nrate_hz = 1000",
        dir.path(),
    )?;
    // The same number of events as fast as the system takes them.
    let saturated = point(
        "unlimited",
        &format!("events = {}", low.events.max(1000)),
        "trigger = \"unlimited\"",
        dir.path(),
    )?;
    let r = LowRate {
        ratio: low.cpu_ns_per_fragment / saturated.cpu_ns_per_fragment.max(1e-9),
        daq_ratio: low.daq_cpu_ns_per_fragment / saturated.daq_cpu_ns_per_fragment.max(1e-9),
        low,
        saturated,
    };
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        for p in [&r.low, &r.saturated] {
            println!(
                "{:<14} {:>7} events {:>9} fragments in {:>5.1} s: CPU {:>5.2} s ({:.0} % of a core), {:>6.0} ns per fragment; without the sources' {:.2} s: {:>6.0} ns",
                p.trigger,
                p.events,
                p.fragments,
                p.wall_s,
                p.cpu_s,
                p.cores_used * 100.0,
                p.cpu_ns_per_fragment,
                p.sources_cpu_s,
                p.daq_cpu_ns_per_fragment
            );
        }
        println!(
            "CPU per fragment at 1 kHz / at saturation: {:.2} (target <= 1.5); the DAQ's own threads: {:.2}",
            r.ratio, r.daq_ratio
        );
    }
    Ok(())
}

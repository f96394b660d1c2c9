//! `tessera bench lowrate`: what a DAQ idling at a low trigger rate costs. The COMET SUPPRESS
//! setup (105 sources of ~380 B on 5 readout units, 1 builder, the recorder writing) runs at a
//! periodic 1 kHz and again at saturation (unlimited trigger); the process's CPU time (user and
//! system, every thread, from getrusage) per fragment at 1 kHz over the same at saturation is the
//! figure (issue 14's target: at most 1.5). A DAQ that costs far more per fragment when little
//! flows spends its CPU on wake-ups, not on data. `--moderation` sweeps the pollers' interrupt
//! moderation (`run.io_moderation_us`), the setting that trades latency for CPU at low rates.

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
    /// The same split by the DAQ's threads: where a low rate's cost per fragment goes.
    pub daq_by_stage_ns_per_fragment: ByStage,
}

/// The DAQ's CPU per fragment (ns) by what its threads do: the pollers and sweepers are
/// measured; `rest` is what remains of the DAQ's figure (the recorder, the trigger, the run
/// control, the acceptors).
#[derive(Debug, Serialize)]
pub struct ByStage {
    pub readout_pollers: f64,
    pub senders: f64,
    pub builder_pollers: f64,
    pub sweepers: f64,
    pub rest: f64,
}

#[derive(Debug, Serialize)]
pub struct LowRate {
    /// `run.io_moderation_us` of both points.
    pub moderation_us: u64,
    pub low: LowRatePoint,
    pub saturated: LowRatePoint,
    /// CPU per fragment at 1 kHz over the same at saturation.
    pub ratio: f64,
    /// The same ratio for the DAQ's own threads.
    pub daq_ratio: f64,
}

/// `run` and `trigger`: the keys of `[run]` (events or duration) and the trigger's in `[sources]`.
fn topology(run: &str, trigger: &str, moderation_us: u64) -> String {
    let mut t = format!(
        "[run]\n{run}\nio_moderation_us = {moderation_us}\nmax_fragment_size = \"4 KiB\"\n[sources]\ncount = 105\nfragment_size = 380\n{trigger}\n\
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

fn point(
    name: &str,
    run: &str,
    trigger: &str,
    moderation_us: u64,
    dir: &std::path::Path,
) -> Result<LowRatePoint> {
    let r = Topology::parse(&topology(run, trigger, moderation_us), name)?;
    let out = dir.join(format!("{name}-{moderation_us}"));
    let crate::Measured {
        report: rep,
        cpu_s,
        sources_cpu_s,
        wall_s,
        stages,
    } = crate::run_measured(&r, &out, name)?;
    let events = rep.events_complete + rep.events_incomplete;
    let fragments = rep.balance.sent;
    let per = |s: f64| s * 1e9 / fragments.max(1) as f64;
    let daq_s = (cpu_s - sources_cpu_s).max(0.0);
    Ok(LowRatePoint {
        trigger: name.into(),
        events,
        fragments,
        wall_s,
        cpu_s,
        cores_used: cpu_s / wall_s.max(1e-9),
        cpu_ns_per_fragment: cpu_s * 1e9 / fragments.max(1) as f64,
        sources_cpu_s,
        daq_cpu_ns_per_fragment: per(daq_s),
        daq_by_stage_ns_per_fragment: ByStage {
            readout_pollers: per(stages.readout_pollers),
            senders: per(stages.senders),
            builder_pollers: per(stages.builder_pollers),
            sweepers: per(stages.sweepers),
            // Two clocks (getrusage and schedstat) that need not agree to the last tick.
            rest: per((daq_s - stages.total()).max(0.0)),
        },
    })
}

pub fn run_lowrate(a: &BenchArgs) -> Result<()> {
    let secs = if a.quick { 2 } else { 6 };
    let dir = tempfile::tempdir()?;
    let moderations = a
        .moderation
        .clone()
        .unwrap_or_else(|| vec![tessera_net::reactor::DEFAULT_MODERATION_US]);
    if !a.json {
        eprintln!(
            "low rate: COMET SUPPRESS (105 sources x 380 B, 5 readout units, 1 builder, recorder) at 1 kHz for {secs} s and at saturation"
        );
    }
    for moderation_us in moderations {
        let r = measure(secs, moderation_us, dir.path())?;
        if a.json {
            println!("{}", serde_json::to_string(&r)?);
            continue;
        }
        println!(
            "run.io_moderation_us = {moderation_us} ({} ms)",
            moderation_us as f64 / 1000.0
        );
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
            let b = &p.daq_by_stage_ns_per_fragment;
            println!(
                "{:<14} the DAQ's ns per fragment: readout pollers {:.0}, senders {:.0}, builder pollers {:.0}, sweepers {:.0}, the rest (recorder, trigger, control) {:.0}",
                "", b.readout_pollers, b.senders, b.builder_pollers, b.sweepers, b.rest
            );
        }
        println!(
            "CPU per fragment at 1 kHz / at saturation: {:.2} (target <= 1.5); the DAQ's own threads: {:.2}",
            r.ratio, r.daq_ratio
        );
    }
    Ok(())
}

/// The pair of points at one moderation: 1 kHz for `secs`, then as many events at saturation.
fn measure(secs: u64, moderation_us: u64, dir: &std::path::Path) -> Result<LowRate> {
    let low = point(
        "periodic-1kHz",
        &format!("duration_s = {secs}"),
        "trigger = \"periodic\"\nrate_hz = 1000",
        moderation_us,
        dir,
    )?;
    // The same number of events as fast as the system takes them.
    let saturated = point(
        "unlimited",
        &format!("events = {}", low.events.max(1000)),
        "trigger = \"unlimited\"",
        moderation_us,
        dir,
    )?;
    Ok(LowRate {
        moderation_us,
        ratio: low.cpu_ns_per_fragment / saturated.cpu_ns_per_fragment.max(1e-9),
        daq_ratio: low.daq_cpu_ns_per_fragment / saturated.daq_cpu_ns_per_fragment.max(1e-9),
        low,
        saturated,
    })
}

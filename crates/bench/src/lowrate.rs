//! `tessera bench lowrate`: what a DAQ idling at a low trigger rate costs. The COMET SUPPRESS
//! setup (105 sources of ~380 B on 5 readout units, 1 builder, the recorder writing) runs at a
//! periodic 1 kHz and again at saturation (unlimited trigger);
//! the process's CPU time (user and system, every thread, from getrusage) per fragment at 1 kHz
//! over the same at saturation is the figure (issue 14's target: at most 1.5). Both are
//! measured over the runs' steady parts, from when the builders have built 20 % of the events to
//! when the sources have sent 95 % of their fragments: a run's start and end cost the same CPU
//! at any rate, and counted in they would pull the two figures towards each other. The whole
//! runs' figures are given beside them. A DAQ that costs far more per fragment when little
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
    /// CPU per fragment over the whole run, start and end included (every thread).
    pub whole_run_cpu_ns_per_fragment: f64,
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
    /// `ratio` over the whole runs, start and end included.
    pub whole_run_ratio: f64,
}

/// The COMET shape: 105 sources over five readout units of 21 links each.
const SOURCES: u64 = 105;
const READOUT_UNITS: u64 = 5;

/// `run` and `trigger`: the keys of `[run]` (events or duration) and the trigger's in `[sources]`.
fn topology(run: &str, trigger: &str, moderation_us: u64) -> String {
    let mut t = format!(
        "[run]\n{run}\nio_moderation_us = {moderation_us}\nmax_fragment_size = \"4 KiB\"\n[sources]\ncount = {SOURCES}\nfragment_size = 380\n{trigger}\n\
         [[builder]]\nid = 0\n[recorder]\nfsync = false\nmax_file_size = \"256 MiB\"\n\
         [monitor]\nenabled = false\n"
    );
    let links = SOURCES / READOUT_UNITS;
    for ru in 0..READOUT_UNITS {
        t += &format!(
            "[[readout]]\nid = {ru}\nsources = \"{}-{}\"\n",
            links * ru,
            links * (ru + 1) - 1
        );
    }
    t
}

/// Where the steady part of a point starts (a fraction of its events built) and ends (a fraction
/// of its fragments sent).
const STEADY: (f64, f64) = (0.2, 0.95);

fn point(
    name: &str,
    events: u64,
    trigger: &str,
    moderation_us: u64,
    dir: &std::path::Path,
) -> Result<LowRatePoint> {
    let r = Topology::parse(
        &topology(&format!("events = {events}"), trigger, moderation_us),
        name,
    )?;
    let out = dir.join(format!("{name}-{moderation_us}"));
    let window = crate::Window {
        events,
        fragments: events * SOURCES,
        from: STEADY.0,
        to: STEADY.1,
    };
    let crate::Measured {
        report: rep,
        cpu_s,
        sources_cpu_s,
        wall_s,
        stages,
        events: built,
        whole_cpu_s,
    } = crate::run_measured(&r, &out, name, Some(window))?;
    let fragments = built * SOURCES;
    let per = |s: f64| s * 1e9 / fragments.max(1) as f64;
    let daq_s = (cpu_s - sources_cpu_s).max(0.0);
    Ok(LowRatePoint {
        trigger: name.into(),
        events: rep.events_complete + rep.events_incomplete,
        fragments,
        wall_s,
        cpu_s,
        cores_used: cpu_s / wall_s.max(1e-9),
        cpu_ns_per_fragment: per(cpu_s),
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
        whole_run_cpu_ns_per_fragment: whole_cpu_s * 1e9 / rep.balance.sent.max(1) as f64,
    })
}

pub fn run_lowrate(a: &BenchArgs) -> Result<()> {
    let (secs, saturated_events) = if a.quick { (2, 40_000) } else { (6, 60_000) };
    let dir = tempfile::tempdir()?;
    let moderations = a
        .moderation
        .clone()
        .unwrap_or_else(|| vec![tessera_net::reactor::DEFAULT_MODERATION_US]);
    if !a.json {
        eprintln!(
            "low rate: COMET SUPPRESS (105 sources x 380 B, 5 readout units, 1 builder, recorder) at 1 kHz for {secs} s and {saturated_events} events at saturation, measured from {:.0} % of the events built to {:.0} % of the fragments sent",
            STEADY.0 * 100.0,
            STEADY.1 * 100.0
        );
    }
    for moderation_us in moderations {
        let r = measure(secs, saturated_events, moderation_us, dir.path())?;
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
            "CPU per fragment at 1 kHz / at saturation: {:.2} (target <= 1.5); the DAQ's own threads: {:.2}; whole runs, start and end included: {:.2} ({:.0} and {:.0} ns)",
            r.ratio, r.daq_ratio, r.whole_run_ratio, r.low.whole_run_cpu_ns_per_fragment, r.saturated.whole_run_cpu_ns_per_fragment
        );
    }
    Ok(())
}

/// The pair of points at one moderation: 1 kHz for `secs`, then `saturated_events` at
/// saturation. Not the same events: at saturation the sources run ahead of the builders by
/// what the buffers on the way hold (here 8 000 to 12 000 events, most in the kernel's socket
/// buffers), so a run of a few thousand events is sent before much of it is read, and the part
/// measured must come before the sources finish.
fn measure(
    secs: u64,
    saturated_events: u64,
    moderation_us: u64,
    dir: &std::path::Path,
) -> Result<LowRate> {
    let events = secs * 1000;
    let low = point(
        "periodic-1kHz",
        events,
        "trigger = \"periodic\"\nrate_hz = 1000",
        moderation_us,
        dir,
    )?;
    let saturated = point(
        "unlimited",
        saturated_events,
        "trigger = \"unlimited\"",
        moderation_us,
        dir,
    )?;
    Ok(LowRate {
        moderation_us,
        ratio: low.cpu_ns_per_fragment / saturated.cpu_ns_per_fragment.max(1e-9),
        daq_ratio: low.daq_cpu_ns_per_fragment / saturated.daq_cpu_ns_per_fragment.max(1e-9),
        whole_run_ratio: low.whole_run_cpu_ns_per_fragment
            / saturated.whole_run_cpu_ns_per_fragment.max(1e-9),
        low,
        saturated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The configuration parses only if every source is read by exactly one unit, so this holds
    /// the unit ranges to `SOURCES` and `READOUT_UNITS`.
    #[test]
    fn the_comet_topology_reads_every_source_once_on_five_units() {
        let t = Topology::parse(
            &topology(
                "events = 10",
                "trigger = \"periodic\"\nrate_hz = 1000",
                20_000,
            ),
            "lowrate",
        )
        .unwrap();
        assert_eq!(u64::from(t.topology.sources.count), SOURCES);
        assert_eq!(t.topology.readout_units.len() as u64, READOUT_UNITS);
    }
}

//! The capacity model of `tessera check` and `tessera scenario`: from a topology's rates and
//! sizes and a calibration of the host (CPU per fragment and per byte of the DAQ's own threads,
//! of the emulated sources and of the recorder; the disk's write rate; the cores), each stage's
//! load at the configured trigger rate, and the rate at which the first of them saturates.
//!
//! Deliberately linear (cost = fragments x per-fragment + bytes x per-byte, as the ATLAS ROS
//! model of eq. 7.2 is): every use prints the prediction beside a measurement (`tessera
//! scenario`), so where the model is wrong is seen, not assumed.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

use crate::{Resolved, SourcesSection, TriggerMode};

/// What `tessera bench calibrate` measured on one host.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Calibration {
    pub host: String,
    pub cpu_model: String,
    /// Cores the process may use when it was measured.
    pub cpus: f64,
    pub measured_unix_s: u64,
    /// CPU of the readout units and builders (every thread but the emulated sources' and the
    /// recorder's own share), per fragment and per payload byte.
    pub daq_ns_per_fragment: f64,
    pub daq_ns_per_byte: f64,
    /// CPU of the emulated sources' driver threads (stand-ins for front-end hardware).
    pub sources_ns_per_fragment: f64,
    pub sources_ns_per_byte: f64,
    /// CPU the recorder adds, uncompressed, per byte recorded.
    pub recorder_ns_per_byte: f64,
    /// Bytes per second written and synced to the output directory's disk.
    pub disk_bytes_per_s: f64,
}

/// Where `tessera bench calibrate` stores the calibration and `tessera check` reads it:
/// `$TESSERA_CALIBRATION`, else `$XDG_DATA_HOME/tessera/calibration.json`, else
/// `~/.local/share/tessera/calibration.json`.
pub fn default_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TESSERA_CALIBRATION") {
        return Some(PathBuf::from(p));
    }
    let base = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))?;
    Some(base.join("tessera").join("calibration.json"))
}

/// This host's processor, as `/proc/cpuinfo` names it.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// Reads a calibration file.
pub fn load(path: &Path) -> Result<Calibration, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let c: Calibration =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let fields = [
        c.cpus,
        c.daq_ns_per_fragment,
        c.daq_ns_per_byte,
        c.sources_ns_per_fragment,
        c.sources_ns_per_byte,
        c.recorder_ns_per_byte,
        c.disk_bytes_per_s,
    ];
    if fields.iter().any(|v| !v.is_finite() || *v < 0.0) || c.cpus <= 0.0 {
        return Err(format!(
            "{}: a figure is negative or not a number: measure again (tessera bench calibrate)",
            path.display()
        ));
    }
    Ok(c)
}

/// The highest trigger rate a paced configuration asks for (the profile's peak where there is
/// one; a burst's triggers all count), or `None` for an unlimited trigger or a scenario file.
pub fn offered_rate(s: &SourcesSection) -> Option<f64> {
    let peak = if s.rate_profile.is_empty() {
        s.rate_hz
    } else {
        s.rate_profile.iter().map(|p| p[1]).fold(0.0, f64::max)
    };
    match s.trigger {
        TriggerMode::Periodic | TriggerMode::Poisson => Some(peak),
        TriggerMode::Bursts => Some(peak * f64::from(s.burst_size.max(1))),
        TriggerMode::Unlimited | TriggerMode::Scenario => None,
    }
}

/// The mean payload size of an emulated fragment: the size histogram's mean where there is
/// one, else `fragment_size`.
pub fn mean_fragment(s: &SourcesSection) -> f64 {
    s.size_histogram
        .as_deref()
        .and_then(|p| crate::read_size_histogram(p).ok())
        .map_or(s.fragment_size.0 as f64, |h| h.mean())
}

/// What the model predicts for a topology.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Prediction {
    /// The configured trigger rate (`None`: as fast as allowed).
    pub offered_hz: Option<f64>,
    /// Payload bytes of one event (every source's mean fragment).
    pub event_bytes: f64,
    /// CPU per event, in ns, by who spends it.
    pub daq_ns_per_event: f64,
    pub sources_ns_per_event: f64,
    pub recorder_ns_per_event: f64,
    /// The rate at which the cores are all used, and at which the disk is (recording).
    pub cpu_limit_hz: f64,
    pub disk_limit_hz: Option<f64>,
    /// The lower of the two, and what it is.
    pub max_rate_hz: f64,
    pub first: String,
    /// Fraction of the cores and of the disk used at the offered rate (`None` when unlimited).
    pub cpu_load: Option<f64>,
    pub disk_load: Option<f64>,
    /// The event rate expected: the offered rate, or the capacity if it is lower.
    pub expected_hz: f64,
}

/// Predicts `r`'s loads from `c`; `mean_fragment` is the mean payload size (the histogram's
/// mean where there is one), `offered_hz` the trigger rate (`None`: as fast as allowed).
pub fn predict(
    r: &Resolved,
    c: &Calibration,
    mean_fragment: f64,
    offered_hz: Option<f64>,
) -> Prediction {
    let t = &r.topology;
    let all = r.source_ru.len().max(1) as f64;
    let emulated = r.emulated_sources().count() as f64;
    let event_bytes = all * mean_fragment;
    let daq = all * (c.daq_ns_per_fragment + c.daq_ns_per_byte * mean_fragment);
    let sources = emulated * (c.sources_ns_per_fragment + c.sources_ns_per_byte * mean_fragment);
    let recording = t.recorder.enabled;
    let recorder = if recording {
        c.recorder_ns_per_byte * event_bytes
    } else {
        0.0
    };
    let per_event = (daq + sources + recorder).max(1e-9);
    let cpu_limit_hz = c.cpus * 1e9 / per_event;
    let disk_limit_hz = (recording && c.disk_bytes_per_s > 0.0 && event_bytes > 0.0)
        .then(|| c.disk_bytes_per_s / event_bytes);
    let (max_rate_hz, first) = match disk_limit_hz {
        Some(d) if d < cpu_limit_hz => (d, "disk".to_string()),
        _ => {
            let share = |x: f64| x / per_event * 100.0;
            (
                cpu_limit_hz,
                format!(
                    "CPU (the DAQ {:.0} %, the emulated sources {:.0} %, the recorder {:.0} % of it)",
                    share(daq),
                    share(sources),
                    share(recorder)
                ),
            )
        }
    };
    Prediction {
        offered_hz,
        event_bytes,
        daq_ns_per_event: daq,
        sources_ns_per_event: sources,
        recorder_ns_per_event: recorder,
        cpu_limit_hz,
        disk_limit_hz,
        max_rate_hz,
        first,
        cpu_load: offered_hz.map(|o| o / cpu_limit_hz),
        disk_load: offered_hz.and_then(|o| disk_limit_hz.map(|d| o / d)),
        expected_hz: offered_hz.map_or(max_rate_hz, |o| o.min(max_rate_hz)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cal() -> Calibration {
        Calibration {
            host: "h".into(),
            cpu_model: "m".into(),
            cpus: 2.0,
            measured_unix_s: 0,
            daq_ns_per_fragment: 1000.0,
            daq_ns_per_byte: 0.5,
            sources_ns_per_fragment: 500.0,
            sources_ns_per_byte: 0.25,
            recorder_ns_per_byte: 0.25,
            disk_bytes_per_s: 100e6,
        }
    }

    fn topology(extra: &str) -> Resolved {
        crate::Topology::parse(
            &format!("[sources]\ncount = 4\nfragment_size = 1000\n{extra}"),
            "t.toml",
        )
        .unwrap()
    }

    #[test]
    fn the_first_stage_to_saturate_and_the_loads_at_the_offered_rate() {
        let r = topology("trigger = \"periodic\"\nrate_hz = 1000\n");
        let p = predict(&r, &cal(), 1000.0, offered_rate(&r.topology.sources));
        // 4 x (1000 + 500) + 4 x (500 + 250) + 0.25 x 4000 = 10 000 ns per event.
        assert!(
            (p.daq_ns_per_event + p.sources_ns_per_event + p.recorder_ns_per_event - 10_000.0)
                .abs()
                < 1e-6
        );
        assert!((p.cpu_limit_hz - 200_000.0).abs() < 1e-6);
        // The disk takes 100 MB/s of 4 kB events: 25 kHz, before the CPU.
        assert_eq!(p.disk_limit_hz, Some(25_000.0));
        assert_eq!(p.first, "disk");
        assert_eq!(p.disk_load, Some(0.04));
        assert_eq!(p.expected_hz, 1000.0);
        let r = topology("trigger = \"unlimited\"\n[recorder]\nenabled = false\n");
        let p = predict(&r, &cal(), 1000.0, offered_rate(&r.topology.sources));
        assert!(p.first.starts_with("CPU"), "{}", p.first);
        assert_eq!(p.offered_hz, None);
        assert!((p.expected_hz - 2e9 / 9000.0).abs() < 1e-6);
    }

    #[test]
    fn a_calibration_file_with_a_bad_figure_is_refused() {
        let d = std::env::temp_dir().join(format!("tessera-cal-{}", std::process::id()));
        let mut c = cal();
        std::fs::write(&d, serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(load(&d).unwrap(), c);
        c.daq_ns_per_byte = -1.0;
        std::fs::write(&d, serde_json::to_string(&c).unwrap()).unwrap();
        assert!(load(&d).unwrap_err().contains("measure again"));
        let _ = std::fs::remove_file(&d);
    }
}

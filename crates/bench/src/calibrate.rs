//! `tessera bench calibrate`: this host's costs for the capacity model of `tessera check` and
//! `tessera scenario` (`tessera_config::capacity`). Three in-process runs at an unlimited
//! trigger (8 sources into 2 readout units and one builder): small fragments and large ones with
//! the recorder off, which split the CPU of the DAQ's threads (and of the emulated sources'
//! driver threads) into a cost per fragment and a cost per byte; the large ones again with the
//! recorder writing, for its cost per byte; and a synced write of the disk the files would go
//! to. CPU is counted in CPU time (getrusage), so a busy machine measures slower rates but the
//! same costs, within its noise: run it on a quiet host, twice, and compare.

use anyhow::{Context, Result};
use std::io::Write;
use std::path::Path;
use std::time::Instant;

use tessera_config::capacity::{self, Calibration};
use tessera_config::Topology;

use crate::BenchArgs;

struct Cost {
    /// Fragments and payload bytes sent.
    fragments: f64,
    bytes: f64,
    /// CPU seconds of the DAQ's threads (all but the sources') and of the sources'.
    daq_s: f64,
    sources_s: f64,
}

fn point(name: &str, size: u64, events: u64, record: bool, dir: &Path) -> Result<Cost> {
    let text = format!(
        "[run]\nevents = {events}\nmax_fragment_size = \"32 KiB\"\n\
         [sources]\ncount = 8\nfragment_size = {size}\ntrigger = \"unlimited\"\n\
         [[readout]]\nid = 0\nsources = \"0-3\"\n[[readout]]\nid = 1\nsources = \"4-7\"\n\
         [[builder]]\nid = 0\n\
         [recorder]\nenabled = {record}\nfsync = false\ncompression = \"none\"\n\
         [monitor]\nenabled = false\n"
    );
    let r = Topology::parse(&text, name)?;
    let m = crate::run_measured(&r, &dir.join(name), name, None)?;
    let fragments = m.report.balance.sent as f64;
    Ok(Cost {
        fragments,
        bytes: fragments * size as f64,
        daq_s: (m.cpu_s - m.sources_cpu_s).max(0.0),
        sources_s: m.sources_cpu_s,
    })
}

/// (ns per fragment, ns per byte) from two points of different fragment sizes.
fn split(small: (&Cost, f64), large: (&Cost, f64)) -> (f64, f64) {
    let per_fragment = |c: &Cost, s: f64| s * 1e9 / c.fragments.max(1.0);
    let (c1, s1) = (
        per_fragment(small.0, small.1),
        small.0.bytes / small.0.fragments.max(1.0),
    );
    let (c2, s2) = (
        per_fragment(large.0, large.1),
        large.0.bytes / large.0.fragments.max(1.0),
    );
    let per_byte = ((c2 - c1) / (s2 - s1).max(1.0)).max(0.0);
    ((c1 - per_byte * s1).max(0.0), per_byte)
}

/// Bytes per second written and synced to a file in `dir`.
fn disk_rate(dir: &Path, bytes: u64) -> Result<f64> {
    let path = dir.join("calibrate.disk");
    let block = vec![0x5Au8; 1 << 20];
    let t0 = Instant::now();
    {
        let mut f =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let mut left = bytes;
        while left > 0 {
            let n = left.min(block.len() as u64) as usize;
            f.write_all(&block[..n])?;
            left -= n as u64;
        }
        f.sync_all()?;
    }
    let s = t0.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&path);
    Ok(bytes as f64 / s.max(1e-9))
}

pub fn run_calibrate(a: &BenchArgs) -> Result<()> {
    let (small_events, large_events, disk_bytes) = if a.quick {
        (20_000, 2_000, 64 << 20)
    } else {
        (100_000, 10_000, 512 << 20)
    };
    // The disk measured is the one the output goes to (default: the current directory's).
    let base = a.output.clone().unwrap_or_else(|| ".".into());
    std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    let dir = tempfile::tempdir_in(&base)
        .with_context(|| format!("a scratch directory in {}", base.display()))?;
    let say = |s: &str| {
        if !a.json {
            eprintln!("calibrate: {s}");
        }
    };
    say("small fragments (256 B), recorder off ...");
    let small = point("small", 256, small_events, false, dir.path())?;
    say("large fragments (16 KiB), recorder off ...");
    let large = point("large", 16 << 10, large_events, false, dir.path())?;
    say("large fragments, recorder writing ...");
    let recorded = point("recorded", 16 << 10, large_events, true, dir.path())?;
    say("the disk, synced ...");
    let disk_bytes_per_s = disk_rate(dir.path(), disk_bytes)?;
    let (daq_f, daq_b) = split((&small, small.daq_s), (&large, large.daq_s));
    let (src_f, src_b) = split((&small, small.sources_s), (&large, large.sources_s));
    let expected = recorded.fragments * daq_f + recorded.bytes * daq_b;
    let recorder_ns_per_byte =
        ((recorded.daq_s * 1e9 - expected) / recorded.bytes.max(1.0)).max(0.0);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    let c = Calibration {
        host,
        cpu_model: capacity::cpu_model(),
        cpus: tessera_net::role::cpu_allowance(),
        measured_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        daq_ns_per_fragment: daq_f,
        daq_ns_per_byte: daq_b,
        sources_ns_per_fragment: src_f,
        sources_ns_per_byte: src_b,
        recorder_ns_per_byte,
        disk_bytes_per_s,
    };
    let path = capacity::default_path()
        .context("no place for the calibration: set TESSERA_CALIBRATION or HOME")?;
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    tessera_archive::write_atomic(&path, serde_json::to_string_pretty(&c)?.as_bytes(), true)
        .with_context(|| format!("writing {}", path.display()))?;
    if a.json {
        println!("{}", serde_json::to_string(&c)?);
    } else {
        println!(
            "DAQ threads: {:.0} ns per fragment + {:.3} ns per byte; emulated sources: {:.0} ns per fragment + {:.3} ns per byte; recorder: {:.3} ns per byte; disk {:.0} MB/s synced; {} cores",
            c.daq_ns_per_fragment,
            c.daq_ns_per_byte,
            c.sources_ns_per_fragment,
            c.sources_ns_per_byte,
            c.recorder_ns_per_byte,
            c.disk_bytes_per_s / 1e6,
            c.cpus
        );
        println!("stored in {} (tessera check reads it)", path.display());
    }
    Ok(())
}

//! `tessera bench record`: the recorder against the disk it writes to (issue 13). Every point is
//! a whole run (8 emulated sources → 2 readout units → 2 builders → the recorder, files synced
//! as configured), and its baseline is measured in the same invocation, just before it, on the
//! same file system: a plain writer writing the same number of bytes in writes of the block size,
//! rotating files at the same size and syncing each one as the recorder does. Figures are ratios
//! to that baseline, because the machines these runs share are noisy.

use anyhow::{Context, Result};
use serde::Serialize;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use tessera_config::{ByteSize, Compression};
use tessera_run::{Options, Session, StatusMode, StopDeadlines};

use crate::{bench_topology, median, BenchArgs, Mode};

#[derive(Clone, Debug, Serialize)]
pub struct RecordPoint {
    pub name: String,
    pub compression: String,
    pub compression_threads: u32,
    pub fsync: bool,
    pub fragment_size: u64,
    pub sources: u32,
    pub events: u64,
    pub events_per_s: f64,
    /// Event data recorded per second (event records, before compression).
    pub event_bytes_per_s: f64,
    /// Bytes written to the files per second (after compression).
    pub file_bytes_per_s: f64,
    /// The plain writer's bytes per second on the same disk, just before.
    pub disk_bytes_per_s: f64,
    /// `file_bytes_per_s` (uncompressed) or `event_bytes_per_s` (compressed) over the disk's.
    pub ratio: f64,
    pub ratio_min: f64,
    pub ratio_max: f64,
    /// Files finished during the run.
    pub files: usize,
    /// Rotation point: the lowest event rate over any one-second window (after the first
    /// second, before the last) over the run's mean rate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lowest_second_over_mean: Option<f64>,
    pub clean: bool,
    pub repeat: usize,
}

struct Plan {
    name: &'static str,
    compression: Compression,
    threads: u32,
    /// Files rotate at this size (the rotation point rotates every ~0.1 s).
    max_file: u64,
    rotation: bool,
}

pub fn run_record(a: &BenchArgs) -> Result<()> {
    let size = a
        .sizes
        .as_ref()
        .and_then(|s| s.first().copied())
        .unwrap_or(16384);
    let n = a
        .sources
        .as_ref()
        .and_then(|s| s.first().copied())
        .unwrap_or(8);
    let bytes = a.bytes.unwrap_or(if a.quick { 0.6e9 } else { 2e9 });
    let repeat = a.repeat.unwrap_or(if a.quick { 1 } else { 3 }).max(1);
    let plan = [
        Plan {
            name: "record",
            compression: Compression::None,
            threads: 2,
            max_file: 1 << 30,
            rotation: false,
        },
        Plan {
            name: "record_lz4",
            compression: Compression::Lz4,
            threads: 1,
            max_file: 1 << 30,
            rotation: false,
        },
        Plan {
            name: "record_lz4",
            compression: Compression::Lz4,
            threads: 2,
            max_file: 1 << 30,
            rotation: false,
        },
        Plan {
            name: "record_zstd",
            compression: Compression::Zstd,
            threads: 1,
            max_file: 1 << 30,
            rotation: false,
        },
        Plan {
            name: "record_zstd",
            compression: Compression::Zstd,
            threads: 2,
            max_file: 1 << 30,
            rotation: false,
        },
        Plan {
            name: "rotation",
            compression: Compression::None,
            threads: 2,
            max_file: 64 << 20,
            rotation: true,
        },
    ];
    let dir = match &a.output {
        Some(p) => p.clone(),
        None => std::env::temp_dir(),
    };
    if !a.json {
        eprintln!(
            "tessera bench record: {} points, ~{:.1} GB each, {} x {} B sources, files synced, under {} (machine: {} cores)",
            plan.len(),
            bytes / 1e9,
            n,
            size,
            dir.display(),
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        println!(
            "{:<12} {:>7} {:>9} {:>10} {:>12} {:>12} {:>12} {:>7} {:>11} {:>6} {:>9} {:>5}",
            "point",
            "threads",
            "events/s",
            "event MB/s",
            "file MB/s",
            "disk MB/s",
            "files",
            "ratio",
            "min-max",
            "",
            "low/mean",
            "clean"
        );
    }
    for p in &plan {
        // The rotation point needs seconds of running to have a lowest second to show.
        let bytes = if p.rotation { bytes.max(2.5e9) } else { bytes };
        let point = measure(p, size, n, bytes, &dir, repeat)?;
        if a.json {
            println!("{}", serde_json::to_string(&point)?);
        } else {
            println!(
                "{:<12} {:>7} {:>9.0} {:>10.1} {:>12.1} {:>12.1} {:>12} {:>7.2} {:>11} {:>6} {:>9} {:>5}",
                point.name,
                point.compression_threads,
                point.events_per_s,
                point.event_bytes_per_s / 1e6,
                point.file_bytes_per_s / 1e6,
                point.disk_bytes_per_s / 1e6,
                point.files,
                point.ratio,
                format!("{:.2}-{:.2}", point.ratio_min, point.ratio_max),
                "",
                point
                    .lowest_second_over_mean
                    .map_or("-".into(), |x| format!("{x:.2}")),
                if point.clean { "yes" } else { "NO" }
            );
        }
    }
    let ship = ship_point(&dir, bytes, repeat)?;
    if a.json {
        println!("{}", serde_json::to_string(&ship)?);
    } else {
        println!(
            "ship to a directory on the same disk: {:.1} MB/s, cp + sync {:.1} MB/s, ratio {:.2} ({:.2}-{:.2}), {} files of {:.1} MB",
            ship.ship_bytes_per_s / 1e6,
            ship.cp_bytes_per_s / 1e6,
            ship.ratio,
            ship.ratio_min,
            ship.ratio_max,
            ship.files,
            ship.bytes as f64 / ship.files.max(1) as f64 / 1e6
        );
    }
    Ok(())
}

/// The shipper's copy rate to a directory on the same disk, against `cp` of the same files
/// followed by `sync` of the copies (the shipper syncs each copy and reads it back).
#[derive(Clone, Debug, Serialize)]
pub struct ShipPoint {
    pub name: String,
    pub files: usize,
    pub bytes: u64,
    pub ship_bytes_per_s: f64,
    pub cp_bytes_per_s: f64,
    pub ratio: f64,
    pub ratio_min: f64,
    pub ratio_max: f64,
    pub repeat: usize,
}

fn ship_point(dir: &Path, bytes: f64, repeat: usize) -> Result<ShipPoint> {
    let data = tempfile::tempdir_in(dir).context("a directory for the files")?;
    // Files as the recorder leaves them: a real run, 256 MiB files.
    let per_event = tessera_format::wire::fragment_wire_size(16384) as u64 * 8;
    let events = ((bytes / 2.0 / per_event as f64) as u64).clamp(2000, 5_000_000);
    let mut r = bench_topology(Mode::Record, 16384, 8, events)?;
    r.topology.recorder.max_file_size = ByteSize(256 << 20);
    r.topology.monitor.enabled = false;
    let (rep, _) = run_sampled(&r, data.path(), false)?;
    let files: Vec<std::path::PathBuf> = rep
        .recorder
        .iter()
        .flat_map(|r| r.files.iter())
        .map(|f| data.path().join(&f.file))
        .collect();
    let total: u64 = files
        .iter()
        .map(|f| std::fs::metadata(f).map_or(0, |m| m.len()))
        .sum();
    let (mut ship, mut cp, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..repeat {
        let to = tempfile::tempdir_in(dir)?;
        let t = Instant::now();
        let st = std::process::Command::new("cp")
            .args(&files)
            .arg(to.path())
            .status()
            .context("cp")?;
        anyhow::ensure!(st.success(), "cp failed");
        let copies: Vec<std::path::PathBuf> = files
            .iter()
            .map(|f| to.path().join(f.file_name().unwrap_or_default()))
            .collect();
        let st = std::process::Command::new("sync")
            .args(&copies)
            .status()
            .context("sync")?;
        anyhow::ensure!(st.success(), "sync failed");
        let c = total as f64 / t.elapsed().as_secs_f64().max(1e-9);
        drop(to);
        let to = tempfile::tempdir_in(dir)?;
        let dest: Vec<Box<dyn tessera_shipper::Destination>> =
            vec![Box::new(tessera_shipper::DirDestination::new(to.path()))];
        // Keep the local files (a day): only the copies are measured.
        let policy = tessera_shipper::Policy {
            keep: Duration::from_secs(86400),
            ..Default::default()
        };
        // A fresh state each time: the run database of the shipper lives beside the files.
        let _ = std::fs::remove_file(data.path().join("runs.sqlite"));
        let mut s = tessera_shipper::Shipper::new(data.path(), dest, policy)?;
        let t = Instant::now();
        let p = s.pass()?;
        let sh = total as f64 / t.elapsed().as_secs_f64().max(1e-9);
        anyhow::ensure!(
            p.verified as usize == files.len() && p.failed == 0,
            "the shipper verified {} of {} files",
            p.verified,
            files.len()
        );
        cp.push(c);
        ship.push(sh);
        ratios.push(sh / c);
    }
    let (s, c) = (median(&mut ship), median(&mut cp));
    Ok(ShipPoint {
        name: "ship".into(),
        files: files.len(),
        bytes: total,
        ship_bytes_per_s: s,
        cp_bytes_per_s: c,
        ratio: s / c,
        ratio_min: ratios.iter().copied().fold(f64::INFINITY, f64::min),
        ratio_max: ratios.iter().copied().fold(0.0, f64::max),
        repeat,
    })
}

fn measure(
    p: &Plan,
    size: u64,
    n: u32,
    bytes: f64,
    dir: &Path,
    repeat: usize,
) -> Result<RecordPoint> {
    let per_event =
        (tessera_format::wire::fragment_wire_size(size as usize) as u64 * n as u64).max(1);
    let events = ((bytes / per_event as f64) as u64).clamp(2000, 5_000_000);
    let mode = if p.compression == Compression::None {
        Mode::Record
    } else {
        Mode::RecordLz4
    };
    let mut r = bench_topology(mode, size, n, events)?;
    let rc = &mut r.topology.recorder;
    rc.compression = p.compression;
    rc.compression_threads = p.threads;
    rc.fsync = true;
    rc.max_file_size = ByteSize(p.max_file);
    r.topology.monitor.enabled = false;
    let (block, max_file) = (rc.block_size.0 as usize, p.max_file);
    let (mut ev, mut evb, mut fb, mut disk, mut ratios, mut lows) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    let (mut clean, mut files) = (true, 0);
    for _ in 0..repeat {
        let run_dir = tempfile::tempdir_in(dir).context("a directory for the files")?;
        // The baseline writes what the recording will (its bytes on disk, the same rotation and
        // syncs), in the same place, just before.
        let expect = if p.compression == Compression::None {
            events * (per_event + 48)
        } else {
            events * per_event / 2
        };
        let base = disk_writer(run_dir.path(), expect, block, max_file)?;
        let (rep, low) = run_sampled(&r, run_dir.path(), p.rotation)?;
        let secs = rep.duration_s.max(1e-9);
        let rec = rep.recorder.as_ref().context("the recorder's report")?;
        let (e, eb, f) = (
            rec.events as f64 / secs,
            rec.record_bytes as f64 / secs,
            rec.file_bytes as f64 / secs,
        );
        files = rec.files.len();
        clean &= rep.ok() && rec.events == events && rep.events_incomplete == 0;
        let measured = if p.compression == Compression::None {
            f
        } else {
            eb
        };
        ev.push(e);
        evb.push(eb);
        fb.push(f);
        disk.push(base);
        ratios.push(measured / base);
        if let Some(l) = low {
            lows.push(l);
        }
    }
    let disk_bps = median(&mut disk);
    let (evb_m, fb_m) = (median(&mut evb), median(&mut fb));
    let measured = if p.compression == Compression::None {
        fb_m
    } else {
        evb_m
    };
    Ok(RecordPoint {
        name: p.name.into(),
        compression: format!("{:?}", p.compression).to_lowercase(),
        compression_threads: p.threads,
        fsync: true,
        fragment_size: size,
        sources: n,
        events,
        events_per_s: median(&mut ev),
        event_bytes_per_s: evb_m,
        file_bytes_per_s: fb_m,
        disk_bytes_per_s: disk_bps,
        ratio: measured / disk_bps,
        ratio_min: ratios.iter().copied().fold(f64::INFINITY, f64::min),
        ratio_max: ratios.iter().copied().fold(0.0, f64::max),
        files,
        lowest_second_over_mean: (!lows.is_empty()).then(|| median(&mut lows)),
        clean,
        repeat,
    })
}

/// A plain writer: `total` bytes in writes of `block`, a new file every `max_file` bytes, each
/// file synced and closed as the recorder does (sync, then the directory). Bytes per second.
pub fn disk_writer(dir: &Path, total: u64, block: usize, max_file: u64) -> Result<f64> {
    let buf: Vec<u8> = (0..block).map(|i| (i * 7 + 3) as u8).collect();
    let t = Instant::now();
    let (mut written, mut seq) = (0u64, 0u32);
    while written < total {
        let path = dir.join(format!("baseline_{seq:04}.dat"));
        seq += 1;
        let mut f = std::fs::File::create(&path)?;
        let mut in_file = 0u64;
        while in_file < max_file && written < total {
            f.write_all(&buf)?;
            in_file += block as u64;
            written += block as u64;
        }
        f.sync_all()?;
        drop(f);
        std::fs::File::open(dir)?.sync_all()?;
    }
    let secs = t.elapsed().as_secs_f64().max(1e-9);
    for s in 0..seq {
        let _ = std::fs::remove_file(dir.join(format!("baseline_{s:04}.dat")));
    }
    Ok(written as f64 / secs)
}

/// Runs `r` with its files under `dir`; with `sample`, the lowest event rate over any one-second
/// window of the recorder's count (sampled every 50 ms, first and last second left out) over
/// the mean.
fn run_sampled(
    r: &tessera_config::Resolved,
    dir: &Path,
    sample: bool,
) -> Result<(tessera_run::Report, Option<f64>)> {
    let opts = Options {
        output: Some(dir.to_path_buf()),
        status: StatusMode::Off,
        manifest: false,
        ..Default::default()
    };
    let session = Session::start(r, &opts)?;
    let t0 = Instant::now();
    let mut samples: Vec<(f64, u64)> = Vec::new();
    let stop_reason = loop {
        std::thread::sleep(Duration::from_millis(if sample { 50 } else { 5 }));
        if sample {
            if let Some(rec) = session.live().recorder {
                samples.push((t0.elapsed().as_secs_f64(), rec.events));
            }
        }
        if let Some(reason) = session.end_reason() {
            break reason;
        }
    };
    let stop = session.stop(&StopDeadlines::from(&r.topology.stop));
    let rep = session.finish(stop_reason, stop)?;
    let low = if sample {
        lowest_over_mean(&samples)
    } else {
        None
    };
    Ok((rep, low))
}

/// The lowest count over any one-second window, over the mean count per second, from the
/// first second to the last one (windows at every sample).
pub fn lowest_over_mean(samples: &[(f64, u64)]) -> Option<f64> {
    let (&(t_first, _), &(t_last, _)) = (samples.first()?, samples.last()?);
    let (from, to) = (t_first + 1.0, t_last - 1.0);
    if to - from < 1.0 {
        return None;
    }
    let at = |t: f64| -> f64 {
        // Linear between the samples around `t`.
        let i = samples.partition_point(|s| s.0 <= t);
        if i == 0 || i >= samples.len() {
            return samples[i.min(samples.len() - 1)].1 as f64;
        }
        let (a, b) = (samples[i - 1], samples[i]);
        a.1 as f64 + (b.1 as f64 - a.1 as f64) * (t - a.0) / (b.0 - a.0).max(1e-9)
    };
    let mean = (at(to) - at(from)) / (to - from);
    let mut low = f64::INFINITY;
    for s in samples.iter().filter(|s| s.0 >= from && s.0 + 1.0 <= to) {
        low = low.min(at(s.0 + 1.0) - at(s.0));
    }
    (mean > 0.0 && low.is_finite()).then(|| low / mean)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lowest_second_is_found_against_the_mean() {
        // 1000 events a second for 6 s, but nothing from 3.0 to 3.5 s.
        let mut s = Vec::new();
        let mut n = 0u64;
        for i in 0..=120 {
            let t = i as f64 * 0.05;
            s.push((t, n));
            if !(3.0..3.5).contains(&t) {
                n += 50;
            }
        }
        let r = lowest_over_mean(&s).unwrap();
        assert!((0.45..0.6).contains(&r), "{r}");
        let flat: Vec<(f64, u64)> = (0..=120).map(|i| (i as f64 * 0.05, i * 50)).collect();
        assert!((lowest_over_mean(&flat).unwrap() - 1.0).abs() < 0.01);
    }
}

//! `tessera ship`: the shipper run by hand or by a service manager beside the recorder, and
//! its status.

use anyhow::{Context, Result};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tessera_shipper::{Destination, Policy, Shipper};

#[derive(clap::Subcommand)]
pub enum ShipCmd {
    /// Copy every finished file of DIR to each destination, verify each copy (size and CRC-32C
    /// read back), and delete local files only once every destination holds a verified copy and
    /// the retention allows. Keeps going (a pass every --interval seconds) until interrupted,
    /// or one pass with --once. What was shipped lives in DIR/runs.sqlite.
    Run {
        /// The recorder's data directory.
        dir: PathBuf,
        /// A destination: a directory (a mounted remote file system), or `s3://bucket/prefix`
        /// (S3-compatible object storage; endpoint and keys from AWS_ENDPOINT_URL, AWS_REGION,
        /// AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY). Repeat for several.
        #[arg(long = "to", required = true)]
        to: Vec<String>,
        /// Keep a shipped file this many seconds after it was finished (0: delete once every
        /// destination holds a verified copy). A day by default, as `shipper.keep_s`: a copy
        /// found damaged later can still be sent again, and --free-watermark frees space first.
        #[arg(long, default_value_t = tessera_config::DEFAULT_KEEP_S)]
        keep_s: f64,
        /// Below this many free bytes on DIR's file system, delete verified files first, oldest
        /// first, whatever --keep-s says (0: off).
        #[arg(long, default_value_t = 0)]
        free_watermark: u64,
        /// Bytes per second all copies may read together (0: no limit).
        #[arg(long, default_value_t = 0)]
        bandwidth: u64,
        /// Seconds between passes.
        #[arg(long, default_value_t = 5.0)]
        interval: f64,
        /// One pass, then exit (status 1 if anything is left to ship).
        #[arg(long)]
        once: bool,
    },
    /// The backlog (files, bytes, oldest file's age) and each file's state per destination.
    Status {
        dir: PathBuf,
        #[arg(long)]
        json: bool,
    },
}

pub fn run(cmd: ShipCmd, stop: &AtomicBool) -> Result<std::process::ExitCode> {
    match cmd {
        ShipCmd::Run {
            dir,
            to,
            keep_s,
            free_watermark,
            bandwidth,
            interval,
            once,
        } => {
            if !(keep_s.is_finite() && keep_s >= 0.0) {
                anyhow::bail!("--keep-s {keep_s}: not a number of seconds");
            }
            if !(interval.is_finite() && interval > 0.0) {
                anyhow::bail!("--interval {interval}: not a positive number of seconds");
            }
            let dests: Vec<Box<dyn Destination>> = to
                .iter()
                .map(|d| tessera_shipper::destination(d).with_context(|| format!("--to {d}")))
                .collect::<Result<_>>()?;
            let policy = Policy {
                keep: Duration::from_secs_f64(keep_s),
                free_watermark,
                bandwidth,
                ..Policy::default()
            };
            let mut s = Shipper::new(&dir, dests, policy)
                .with_context(|| format!("shipping from {}", dir.display()))?;
            loop {
                let p = s.pass()?;
                let b = &p.backlog;
                eprintln!(
                    "tessera ship: {} copied, {} verified, {} failed, {} deleted; backlog {} files, {:.1} MB, oldest {:.0} s{}",
                    p.copied,
                    p.verified,
                    p.failed,
                    p.deleted,
                    b.files,
                    b.bytes as f64 / 1e6,
                    b.oldest_s,
                    b.drain_s
                        .map_or(String::new(), |d| format!(", drains in ~{d:.0} s"))
                );
                if once {
                    return Ok(if b.files == 0 {
                        std::process::ExitCode::SUCCESS
                    } else {
                        std::process::ExitCode::from(1)
                    });
                }
                let t = std::time::Instant::now();
                while t.elapsed().as_secs_f64() < interval {
                    if stop.load(Ordering::Relaxed) {
                        return Ok(std::process::ExitCode::SUCCESS);
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        ShipCmd::Status { dir, json } => {
            let db = tessera_rundb::RunDb::open(&dir.join("runs.sqlite"))?;
            let rows = db.shipments()?;
            let mut names: Vec<String> = rows.iter().map(|r| r.destination.clone()).collect();
            names.sort();
            names.dedup();
            let b = tessera_shipper::backlog(&dir, &db, &names)?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({"backlog": b, "destinations": names, "shipments": rows, "deleted": db.deleted_files()?})
                );
            } else {
                println!(
                    "backlog: {} files, {:.1} MB, oldest {:.0} s, to {}",
                    b.files,
                    b.bytes as f64 / 1e6,
                    b.oldest_s,
                    if names.is_empty() {
                        "(no destination yet)".into()
                    } else {
                        names.join(", ")
                    }
                );
                for r in &rows {
                    println!(
                        "{:<32} {:<30} {:<9} attempts {}{}",
                        r.file,
                        r.destination,
                        r.state,
                        r.attempts,
                        r.error
                            .as_deref()
                            .map_or(String::new(), |e| format!("  {e}"))
                    );
                }
            }
            Ok(std::process::ExitCode::SUCCESS)
        }
    }
}

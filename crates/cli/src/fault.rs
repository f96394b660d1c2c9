//! `tessera fault`: an operator's fault rehearsal in a running run, through the run control's
//! HTTP API (`POST /api/faults`), so that it is checked, time-boxed, logged and kept in the run
//! database with who asked exactly as one from the dashboard.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};

#[derive(Args)]
pub struct FaultArgs {
    #[command(subcommand)]
    what: FaultWhat,
    /// The run control: `host:port` or a URL (default: `control.addr` in `--data`, else
    /// 127.0.0.1:8080).
    #[arg(long, global = true)]
    control: Option<String>,
    /// The run's output directory, whose `control.addr` names the run control.
    #[arg(long, global = true)]
    data: Option<std::path::PathBuf>,
    /// How long, in seconds (1 to 600).
    #[arg(long = "for", global = true, default_value_t = 10)]
    seconds: u64,
    /// Who asks (default: $USER), kept with the fault.
    #[arg(long, global = true)]
    operator: Option<String>,
}

#[derive(Subcommand)]
enum FaultWhat {
    /// An emulated source: `delay MS`, or one of `[[inject]]`'s kinds (bad_crc, bad_marker,
    /// truncate, duplicate, skip, swap, disconnect, status_error) on every event.
    Source {
        id: u32,
        kind: String,
        /// `delay`: milliseconds per fragment.
        value: Option<f64>,
    },
    /// The recorder: `throttle RATE` (bytes per second written, `5 MB`): a slow disk.
    Recorder { kind: String, rate: String },
    /// The faults under way.
    List,
}

pub fn run(a: FaultArgs) -> Result<()> {
    let base = match (&a.control, &a.data) {
        (Some(c), _) => c.clone(),
        (None, Some(d)) => std::fs::read_to_string(d.join("control.addr"))
            .with_context(|| format!("no run control's address in {}", d.display()))?
            .trim()
            .to_string(),
        (None, None) => "127.0.0.1:8080".into(),
    };
    let base = if base.starts_with("http://") || base.starts_with("https://") {
        base
    } else {
        format!("http://{base}")
    };
    let client = reqwest::blocking::Client::builder()
        .timeout(std::time::Duration::from_secs(30))
        .build()?;
    let body = match a.what {
        FaultWhat::List => {
            let r = client.get(format!("{base}/api/faults")).send()?;
            let v: serde_json::Value = r.json()?;
            let active = v["active"].as_array().cloned().unwrap_or_default();
            if active.is_empty() {
                println!("no fault under way");
            }
            for f in active {
                println!("{} (by {}): {}", f["fault"], f["who"], f["result"]);
            }
            return Ok(());
        }
        FaultWhat::Source { id, kind, value } => serde_json::json!({
            "target": "source", "id": id, "kind": kind, "seconds": a.seconds, "value": value,
        }),
        FaultWhat::Recorder { kind, rate } => {
            let rate = tessera_config::ByteSize::parse(&rate)
                .map_err(|e| anyhow::anyhow!("rate {rate:?}: {e}"))?;
            serde_json::json!({
                "target": "recorder", "kind": kind, "seconds": a.seconds, "value": rate.0 as f64,
            })
        }
    };
    let who = a
        .operator
        .or_else(|| std::env::var("USER").ok())
        .unwrap_or_else(|| "unknown".into());
    let mut req = client
        .post(format!("{base}/api/faults"))
        .header("X-Tessera-Operator", format!("{who} (tessera fault)"))
        .json(&body);
    if let Ok(t) = std::env::var("TESSERA_TOKEN") {
        req = req.bearer_auth(t.trim());
    }
    let r = req
        .send()
        .with_context(|| format!("the run control at {base}"))?;
    let status = r.status();
    let v: serde_json::Value = r.json().unwrap_or_default();
    if !status.is_success() {
        bail!(
            "refused ({}): {}",
            status.as_u16(),
            v["error"].as_str().unwrap_or("no reason given")
        );
    }
    println!(
        "{}",
        v["result"]
            .as_str()
            .unwrap_or_default()
            .trim_start_matches("ok: ")
    );
    Ok(())
}

//! The shipper a long-running process keeps beside its recorder's data directory (the run
//! control in one process, the node agent of the recorder's host): started at configure, kept
//! across runs and configures while its settings stay the same, so that files drain between
//! runs too.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use tessera_config::{ShipperSection, Topology};
use tessera_shipper::{Destination, Policy, ShipperService};

#[derive(Debug)]
pub struct HeldShipper {
    settings: (ShipperSection, u64, PathBuf, PathBuf),
    pub service: Arc<ShipperService>,
}

/// Brings `held` in line with `t` for the data directory `output`: started, restarted with new
/// settings, kept, or stopped (no `shipper.to`, or no recording).
pub fn ensure(held: &mut Option<HeldShipper>, t: &Topology, output: &Path) -> Result<()> {
    let s = &t.shipper;
    if s.to.is_empty() || !t.recorder.enabled {
        stop(held);
        return Ok(());
    }
    let settings = (
        s.clone(),
        s.watermark(&t.recorder),
        output.to_path_buf(),
        output.join(&t.control.database),
    );
    if held.as_ref().is_some_and(|h| h.settings == settings) {
        return Ok(());
    }
    // The old one ends (after its pass) before the new one reads the same directory; a
    // finished run's session may still hold it, so it is stopped, not only let go.
    stop(held);
    let dests: Vec<Box<dyn Destination>> =
        s.to.iter()
            .enumerate()
            .map(|(i, d)| {
                tessera_shipper::destination(d).with_context(|| format!("shipper.to[{i}] = {d:?}"))
            })
            .collect::<Result<_>>()?;
    let policy = Policy {
        keep: Duration::from_secs_f64(s.keep_s),
        free_watermark: settings.1,
        bandwidth: s.bandwidth.0,
        ..Policy::default()
    };
    let service = ShipperService::start(
        output,
        &settings.3,
        dests,
        policy,
        Duration::from_secs_f64(s.interval_s),
    )
    .with_context(|| format!("starting the shipper of {}", output.display()))?;
    tracing::info!(dir = %output.display(), to = ?s.to, "shipper started");
    *held = Some(HeldShipper {
        settings,
        service: Arc::new(service),
    });
    Ok(())
}

/// Stops the held shipper (after the pass under way).
pub fn stop(held: &mut Option<HeldShipper>) {
    if let Some(h) = held.take() {
        h.service.stop();
    }
}

//! Runs a topology with one external source driven by the test itself (a peer written from the
//! spec, in `spec_source.rs`): shared by the end-to-end tests that need one.

use std::path::Path;
use tessera_config::Resolved;
use tessera_run::{Options, Report, StatusMode};

/// Runs `t` with the external source `id` driven by `source`, which gets the address to connect
/// to once everything listens.
pub fn run_with_external(
    t: &Resolved,
    out: &Path,
    id: u32,
    source: impl FnOnce(String) + Send + 'static,
) -> Report {
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<(u32, String)>>(1);
    let ext = std::thread::spawn(move || {
        let addrs = rx.recv().unwrap();
        source(addrs.into_iter().find(|(s, _)| *s == id).unwrap().1);
    });
    let opts = Options {
        output: Some(out.to_path_buf()),
        status: StatusMode::Off,
        ready: Some(tx),
        ..Default::default()
    };
    let rep = tessera_run::run(t, &opts).unwrap();
    ext.join().unwrap();
    rep
}

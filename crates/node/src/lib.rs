//! A run spread over hosts. Each host runs a node agent ([`agent`], `tessera node`), started by
//! what the site already runs (systemd, OpenSSH, Kubernetes); the run control drives every
//! agent through one state machine ([`cluster`]) over the node protocol
//! (`tessera-node-protocol`, docs/node-protocol.md). An agent runs its host's roles through the
//! same [`tessera_run::Session`] as `tessera run` in one process; the data between roles on
//! different hosts crosses the network exactly as it crosses loopback in one process.

pub mod agent;
pub mod cluster;
pub mod launch;
mod link;
pub mod logbook;
pub mod metrics;
pub mod tls;

pub use agent::{host_name, serve, AgentOptions, Trust};
pub use cluster::{Cluster, ClusterRun};

/// This build's name and version, said in hellos.
/// 16 random bytes in hex, new on every call: a hello's or a challenge's nonce.
pub(crate) fn fresh_nonce() -> String {
    let b: [u8; 16] = rand::random();
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn software() -> String {
    format!("tessera {}", env!("CARGO_PKG_VERSION"))
}

/// A stop's deadlines as the node protocol carries them, and back.
pub(crate) fn to_wire(d: &tessera_run::StopDeadlines) -> tessera_node_protocol::Deadlines {
    let tessera_run::StopDeadlines {
        sources_ms,
        readout_ms,
        builders_ms,
        recorder_ms,
        abort_grace_ms,
        max_ms,
    } = *d;
    tessera_node_protocol::Deadlines {
        sources_ms,
        readout_ms,
        builders_ms,
        recorder_ms,
        abort_grace_ms,
        max_ms,
    }
}

pub(crate) fn from_wire(d: &tessera_node_protocol::Deadlines) -> tessera_run::StopDeadlines {
    let tessera_node_protocol::Deadlines {
        sources_ms,
        readout_ms,
        builders_ms,
        recorder_ms,
        abort_grace_ms,
        max_ms,
    } = *d;
    tessera_run::StopDeadlines {
        sources_ms,
        readout_ms,
        builders_ms,
        recorder_ms,
        abort_grace_ms,
        max_ms,
    }
}

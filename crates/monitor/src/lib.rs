//! The monitor (role 7; the CODA ET model): every recorded event passes through a chain of
//! stations, where consumers (event displays, data-quality checks, a second recorder) get them.
//!
//! - [`chain`]: the stations, their queues, selections, prescales and restore policies, and the
//!   consumers in this process ([`LocalConsumer`]).
//! - [`server`]: the TCP service of `docs/monitor-protocol.md`.
//! - [`client`]: the consumer side over TCP, with heartbeats and reattachment.
//!
//! A blocking station holds every selected event until a consumer puts it back (it can hold the
//! data path: that is its purpose); a sampling station copies what fits in its queue and never
//! holds anything up.

pub mod chain;
pub mod client;
pub mod console;
pub mod server;
pub mod wire;

pub use chain::{Event, LocalConsumer, Monitor, MonitorError, MonitorStatus, StationStatus};
pub use client::{ClientError, ClientOptions, Consumer, ReceivedEvent};
pub use server::{Server, ServerOptions};
pub use tessera_format::monitor::Wait;

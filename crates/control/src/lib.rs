pub mod alarms;
pub mod controller;
pub mod history;
pub mod http;
pub mod metrics;
pub mod recovery;
pub mod sampler;
pub mod state;

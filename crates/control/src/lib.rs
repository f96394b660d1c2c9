pub mod controller;
pub mod http;
pub mod metrics;
pub mod sampler;
pub mod state;

//! The sidecar (`<file>.json`) that describes a finished file, and the names of files.

use serde::Serialize;

/// `run000012_0003.tsr`
pub fn file_name(run: u64, seq: u32) -> String {
    format!("run{run:06}_{seq:04}.tsr")
}

/// A finished file, as its sidecar describes it.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct FileInfo {
    pub file: String,
    pub format_version: u16,
    pub run_number: u64,
    pub sequence: u32,
    pub size_bytes: u64,
    pub events: u64,
    pub incomplete_events: u64,
    pub fragments: u64,
    pub record_bytes: u64,
    pub blocks: u32,
    pub compression: String,
    pub filter: String,
    pub file_crc32c: String,
    pub first_event_id: Option<u64>,
    pub last_event_id: Option<u64>,
    pub start_time_unix_ns: u64,
    pub end_time_unix_ns: u64,
    pub config_sha256: String,
    /// Payload pattern of the emulated sources (`verify` regenerates and compares it).
    pub pattern: String,
    /// Every source an event is expected to hold.
    #[serde(default)]
    pub sources: Vec<u32>,
    /// The sources whose payloads follow `pattern` (the emulated ones).
    #[serde(default)]
    pub pattern_sources: Vec<u32>,
    /// Closed by recovery after a crash (`tessera recover`), not by its recorder: it holds the
    /// whole blocks the crash left, its `end_time_unix_ns` is 0.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub recovered: bool,
}

//! The sidecar (`<file>.json`) that describes a finished file, and the names of files.

use serde::Serialize;

/// `run000012_0003.tsr`
pub fn file_name(run: u64, seq: u32) -> String {
    format!("run{run:06}_{seq:04}.tsr")
}

/// `run000012_calibration_0003.tsr` for a named stream, [`file_name`] for the main files.
pub fn stream_file_name(run: u64, stream: Option<&str>, seq: u32) -> String {
    match stream {
        Some(s) => format!("run{run:06}_{s}_{seq:04}.tsr"),
        None => file_name(run, seq),
    }
}

/// The stream a file's name says it belongs to (`run000012_calibration_0003.tsr`), if any.
pub fn stream_of_name(name: &str) -> Option<String> {
    let base = name.strip_suffix(".tsr")?.strip_prefix("run")?;
    let (_run, rest) = base.split_once('_')?;
    let (stream, _seq) = rest.rsplit_once('_')?;
    (!stream.is_empty()).then(|| stream.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_run_stream_and_sequence() {
        assert_eq!(stream_file_name(12, None, 3), "run000012_0003.tsr");
        let n = stream_file_name(12, Some("calibration"), 3);
        assert_eq!(n, "run000012_calibration_0003.tsr");
        assert_eq!(stream_of_name(&n).as_deref(), Some("calibration"));
        assert_eq!(stream_of_name("run000012_0003.tsr"), None);
        assert_eq!(stream_of_name("junk"), None);
    }
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
    /// The stream it belongs to (`recorder.streams`); none: the main files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<String>,
}

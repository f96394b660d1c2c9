//! The node-agent protocol (docs/node-protocol.md): what the run control and a node agent
//! (`tessera node`) say to each other over one TCP connection. Each message is a frame: a
//! 32-bit little-endian length, then that many bytes of one JSON object whose `type` names
//! it. The run control asks, the agent answers each request in order; while a request takes
//! long (a stop stage draining a slow disk) the agent sends `working` every second, so that
//! a silent agent is a lost one within `control.agent_timeout_ms` whatever it is doing.
//!
//! Pure: no I/O, no clocks. The payloads of `status`, `report` and `why` are the run's own
//! JSON documents (docs/openapi.json: `Live`, `Report`, `WhyIncomplete`), carried as they are.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The protocol revision this build speaks. Peers of another revision refuse each other in
/// their hellos, naming both.
pub const PROTOCOL: u32 = 4;

/// Largest frame body accepted once the peer is known (a run's report with its file list).
pub const MAX_FRAME: usize = 64 << 20;

/// Largest frame body accepted before the hello passed: a stranger cannot make a peer
/// allocate more than this.
pub const MAX_HELLO: usize = 64 << 10;

/// A stop's stage deadlines, as `[stop]` gives them (milliseconds).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deadlines {
    pub sources_ms: u64,
    pub readout_ms: u64,
    pub builders_ms: u64,
    pub recorder_ms: u64,
    pub abort_grace_ms: u64,
    pub max_ms: u64,
}

/// One line of the message log: what a role or an agent said (INFO and above).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogLine {
    /// Rising per process (an agent's own numbering; the run control renumbers what it keeps).
    pub seq: u64,
    pub unix_ns: u64,
    /// The host (its `[hosts]` name); empty where the run control fills it in.
    #[serde(default)]
    pub host: String,
    /// `readout`, `builder`, `event_manager`, `recorder`, `monitor`, `sources`, `node`,
    /// `run_control`, or the Rust module for anything else.
    pub role: String,
    /// `ERROR`, `WARN`, `INFO`.
    pub level: String,
    /// The run it is about, where the line says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<u64>,
    pub message: String,
}

/// From the run control to an agent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// The first message: who speaks, in which revision, and a fresh nonce the agent's proof
    /// covers (the token itself never crosses the connection).
    Hello {
        protocol: u32,
        software: String,
        nonce: String,
    },
    /// The run control's proof that it holds the token: [`proof`] over
    /// [`RUN_CONTROL_PROOF`], the agent's challenge nonce, then its own hello's nonce.
    Proof {
        proof: String,
    },
    /// Take the roles `[hosts]` places on `host` in this topology: check them (output
    /// directory, memory) and bind their listening sockets. Answered by `configured` or
    /// `problems`.
    Configure {
        topology: String,
        origin: String,
        host: String,
    },
    /// Start the roles for run `run_number`, every listening socket of the run at the given
    /// addresses (keys as in `configured`), the emulated sources holding their triggers until
    /// `release`.
    Start {
        run_number: u64,
        addresses: BTreeMap<String, String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        events: Option<u64>,
    },
    /// Every host has started: the emulated sources begin triggering.
    Release {},
    /// Hold the triggers (a pause, or the first step of a stop) and say where this host's
    /// sources end. Answered by `held`.
    Hold {},
    /// Have the held sources send up to `end` (exclusive): the highest `claimed` of every host,
    /// so that no event is sent by only some sources.
    Align {
        end: u64,
    },
    Resume {},
    /// Answered by `status`.
    Status {},
    /// Every role is told to stop (each finishes once its upstream has ended).
    StopBegin {
        deadlines: Deadlines,
    },
    /// One stage of the stop on this host: `sources`, `readout`, `builders`, `recorder`.
    /// Answered by `stage`.
    StopStage {
        stage: String,
        deadlines: Deadlines,
    },
    /// End the run here. Answered by `report`.
    Finish {
        stop_reason: String,
    },
    /// What this host's roles counted so far (the run goes on). Answered by `report`.
    Report {},
    /// "Why is event N incomplete", as this host sees it. Answered by `why`.
    Why {
        event_id: u64,
    },
    /// Drop the configuration (and a run still open, aborted): back to idle.
    Reset {},
    /// The files of run `run` in this host's output directory, for a run the run control
    /// closes as crashed (it died during the run): each `.part` of the run is finished first, as
    /// `tessera recover` does. Refused while a run is open here. Answered by `run_files`
    /// (revision 3).
    RunFiles {
        run: u64,
    },
    /// This host's report of run `run` as it kept it when it lost the run control mid-run
    /// (`run<N>.<host>.report.json`), for a run control gathering the counts it could not get
    /// at the run's end. Answered by `report` (revision 4).
    KeptReport {
        run: u64,
    },
}

/// From an agent to the run control.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    /// The agent's answer to a hello of its revision: a fresh nonce for the run control's proof.
    Challenge {
        nonce: String,
    },
    Hello {
        protocol: u32,
        software: String,
        /// The agent's proof that it holds the token: [`proof`] over [`AGENT_PROOF`], the
        /// run control's hello nonce, then the challenge nonce.
        #[serde(default)]
        proof: String,
        /// The agent's own host name (the system's), for messages.
        host: String,
        /// Where the agent serves its host's `/metrics` (`host:port`), if it does: the run
        /// control lists it for Prometheus (revision 2).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        metrics: Option<String>,
    },
    /// The hello was refused (revision, token, another run control already driving this
    /// agent); the agent closes the connection after it.
    Refused {
        reason: String,
    },
    /// Done.
    Ok {},
    /// Configured: the roles it will run and where each listening socket is bound.
    Configured {
        roles: Vec<String>,
        addresses: BTreeMap<String, String>,
    },
    /// What is wrong with this host's part, one line each.
    Problems {
        problems: Vec<String>,
    },
    /// The request could not be carried out.
    Error {
        message: String,
    },
    /// The files of a run on this host: each one's sidecar (`FileInfo`), and the `.part` files
    /// finished to make them.
    RunFiles {
        files: Vec<serde_json::Value>,
        recovered: Vec<String>,
    },
    /// The host's part now: `live` (a `Live` document), whether its sources have all ended,
    /// whether its recorder's disk is full, and its new log lines.
    Status {
        live: serde_json::Value,
        sources_ended: bool,
        disk_full: bool,
        /// What the agent and its roles logged since the last `status` (at most 1 000 lines;
        /// more are left for the next).
        #[serde(default)]
        logs: Vec<LogLine>,
    },
    Stage {
        report: serde_json::Value,
    },
    /// The triggers are held; this host's sources end at `claimed` (exclusive; 0: no emulated
    /// sources here).
    Held {
        claimed: u64,
    },
    Report {
        report: serde_json::Value,
    },
    Why {
        answer: serde_json::Value,
    },
    /// Still working on the request (sent every second while it lasts).
    Working {},
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("frame of {len} bytes, more than the {max} allowed here")]
    TooLong { len: usize, max: usize },
    #[error("frame is not a message: {0}")]
    Json(String),
}

/// One frame holding `msg`.
pub fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    let body = serde_json::to_vec(msg).expect("messages serialise");
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// The body length a frame header announces, checked against `max` before anything is
/// allocated for it. `None`: fewer than 4 bytes.
pub fn frame_len(header: &[u8], max: usize) -> Result<Option<usize>, FrameError> {
    let Some(h) = header.get(..4) else {
        return Ok(None);
    };
    let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
    if len > max {
        return Err(FrameError::TooLong { len, max });
    }
    Ok(Some(len))
}

/// The message in a frame body.
pub fn decode<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, FrameError> {
    serde_json::from_slice(body).map_err(|e| FrameError::Json(e.to_string()))
}

/// A whole frame at the start of `buf`: the message and the bytes it took; `None` if `buf`
/// holds less than one frame.
pub fn decode_frame<'a, T: Deserialize<'a>>(
    buf: &'a [u8],
    max: usize,
) -> Result<Option<(T, usize)>, FrameError> {
    let Some(len) = frame_len(buf, max)? else {
        return Ok(None);
    };
    let Some(body) = buf.get(4..4 + len) else {
        return Ok(None);
    };
    Ok(Some((decode(body)?, 4 + len)))
}

/// What the run control's proof is taken over, before the nonces: a proof made for one use
/// cannot be replayed as the other. (Fixed labels: they name the revision that brought proofs.)
pub const RUN_CONTROL_PROOF: &str = "tessera node protocol 3: run control";
/// What the agent's proof is taken over, before the nonces.
pub const AGENT_PROOF: &str = "tessera node protocol 3: agent";

pub use tessera_format::auth::{proof, proof_holds};

/// The test vectors of docs/node-protocol.md: (name, message, frame as hex).
pub fn vectors() -> Vec<(&'static str, String)> {
    let hello = Request::Hello {
        protocol: PROTOCOL,
        software: "tessera 0.1.0".into(),
        nonce: "c0ffee".into(),
    };
    let challenge = Reply::Challenge {
        nonce: "a9e17".into(),
    };
    let configured = Reply::Configured {
        roles: vec!["readout unit 0".into()],
        addresses: [("readout:0".to_string(), "10.77.1.2:40001".to_string())].into(),
    };
    let welcome = Reply::Hello {
        protocol: PROTOCOL,
        software: "tessera 0.1.0".into(),
        host: "fe1-pc".into(),
        metrics: Some("10.77.1.2:9300".into()),
        proof: proof("s3cret", AGENT_PROOF, "c0ffee", "a9e17"),
    };
    vec![
        ("hello", hex(&encode(&hello))),
        ("challenge", hex(&encode(&challenge))),
        (
            "run control proof",
            proof("s3cret", RUN_CONTROL_PROOF, "a9e17", "c0ffee"),
        ),
        ("agent hello", hex(&encode(&welcome))),
        ("release", hex(&encode(&Request::Release {}))),
        ("configured", hex(&encode(&configured))),
        ("kept_report", hex(&encode(&Request::KeptReport { run: 7 }))),
    ]
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_frame_round_trips_and_a_short_buffer_is_not_a_frame() {
        let m = Request::StopStage {
            stage: "readout".into(),
            deadlines: Deadlines {
                sources_ms: 1,
                readout_ms: 2,
                builders_ms: 3,
                recorder_ms: 4,
                abort_grace_ms: 5,
                max_ms: 0,
            },
        };
        let f = encode(&m);
        let (back, used) = decode_frame::<Request>(&f, MAX_FRAME).unwrap().unwrap();
        assert_eq!((back, used), (m, f.len()));
        assert_eq!(
            decode_frame::<Request>(&f[..f.len() - 1], MAX_FRAME),
            Ok(None)
        );
        assert_eq!(decode_frame::<Request>(&f[..3], MAX_FRAME), Ok(None));
    }

    #[test]
    fn the_length_is_checked_before_anything_is_sized_by_it() {
        let mut f = encode(&Request::Release {});
        f[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            frame_len(&f, MAX_HELLO),
            Err(FrameError::TooLong {
                len: u32::MAX as usize,
                max: MAX_HELLO
            })
        );
    }

    #[test]
    fn unknown_types_and_fields_are_refused_not_guessed() {
        assert!(decode::<Request>(br#"{"type":"launch_missiles"}"#).is_err());
        assert!(decode::<Request>(br#"{"type":"release","extra":1}"#).is_err());
        assert!(decode::<Request>(br#"[1,2]"#).is_err());
    }

    #[test]
    fn the_vectors_are_what_the_spec_says() {
        // docs/node-protocol.md §5 prints these; a change here is a change of the protocol.
        let doc = include_str!("../../../docs/node-protocol.md");
        for (name, hex) in vectors() {
            assert!(
                doc.contains(&format!("`{hex}`")),
                "vector {name} ({hex}) is not in docs/node-protocol.md"
            );
        }
    }

    proptest! {
        #[test]
        fn no_input_panics(b in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_frame::<Request>(&b, MAX_HELLO);
            let _ = decode_frame::<Reply>(&b, MAX_FRAME);
        }
    }
}

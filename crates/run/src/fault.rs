//! Fault rehearsal: an operator injects a fault into a running run, time-boxed, to see the
//! system survive it and the crew's tools name it (`tessera fault`, `POST /api/faults`, the
//! dashboard). What this process can inject: into an emulated source, one of `[[inject]]`'s
//! kinds or a delay; into the recorder, a slow disk. Each is checked before anything happens,
//! and refused with the reason where it cannot be done or the run could not survive it.

use serde::{Deserialize, Serialize};
use std::time::Duration;

use tessera_config::InjectKind;

/// The longest fault, seconds: a rehearsal, not a way of running.
pub const MAX_SECONDS: u64 = 600;

/// A fault asked for.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    /// `source` or `recorder`.
    pub target: String,
    /// The source ID (a source).
    #[serde(default, deserialize_with = "whole_opt")]
    pub id: Option<u32>,
    /// A source: one of `[[inject]]`'s kinds (`bad_crc`, `bad_marker`, `truncate`,
    /// `duplicate`, `skip`, `swap`, `disconnect`, `status_error`) or `delay`. The recorder:
    /// `throttle`.
    pub kind: String,
    /// How long, in seconds (1 to 600; a disconnect is for good).
    #[serde(deserialize_with = "whole")]
    pub seconds: u64,
    /// `delay`: milliseconds per fragment (1 to 10 000); `throttle`: bytes per second written
    /// (at least 100 000).
    #[serde(default)]
    pub value: Option<f64>,
}

/// A whole number, which JSON may write `60` or `60.0`.
fn whole<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let v = f64::deserialize(d)?;
    if v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v <= u64::MAX as f64 {
        Ok(v as u64)
    } else {
        Err(serde::de::Error::custom(format!(
            "{v} is not a whole number"
        )))
    }
}

fn whole_opt<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    match Option::<f64>::deserialize(d)? {
        None => Ok(None),
        Some(v) if v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v <= u32::MAX as f64 => {
            Ok(Some(v as u32))
        }
        Some(v) => Err(serde::de::Error::custom(format!("{v} is not a source ID"))),
    }
}

/// What a fault does, checked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Checked {
    Source(u32, tessera_source::SourceFault),
    RecorderThrottle(u64),
}

impl Fault {
    /// Checks the fault's own fields (not yet whether this run has its target).
    pub fn check(&self) -> Result<Checked, String> {
        if !(1..=MAX_SECONDS).contains(&self.seconds) {
            return Err(format!(
                "seconds: {} is not from 1 to {MAX_SECONDS}",
                self.seconds
            ));
        }
        match self.target.as_str() {
            "source" => {
                let id = self
                    .id
                    .ok_or("a source fault names its source: `id`")?;
                if self.kind == "delay" {
                    let ms = self
                        .value
                        .ok_or("a delay gives its milliseconds per fragment: `value`")?;
                    if !(1.0..=10_000.0).contains(&ms) {
                        return Err(format!("delay: {ms} ms is not from 1 to 10 000"));
                    }
                    return Ok(Checked::Source(
                        id,
                        tessera_source::SourceFault::Delay(Duration::from_secs_f64(ms / 1e3)),
                    ));
                }
                let kind: InjectKind =
                    serde_json::from_value(serde_json::Value::String(self.kind.clone()))
                        .map_err(|_| {
                            format!(
                                "a source fault is delay, bad_crc, bad_marker, truncate, duplicate, skip, swap, disconnect or status_error, not {:?}",
                                self.kind
                            )
                        })?;
                Ok(Checked::Source(id, tessera_source::SourceFault::Inject(kind)))
            }
            "recorder" => {
                if self.kind != "throttle" {
                    return Err(format!(
                        "a recorder fault is throttle (a slow disk), not {:?}",
                        self.kind
                    ));
                }
                let rate = self
                    .value
                    .ok_or("a throttle gives the bytes per second written: `value`")?;
                // Slower than this, a stop's drain could not end within any deadline that a
                // run's buffers allow: the run would not survive it whole.
                if !(rate.is_finite() && rate >= 100_000.0) {
                    return Err(format!(
                        "throttle: {rate} B/s would hold the run's buffers past any stop's deadline; at least 100 000 B/s"
                    ));
                }
                Ok(Checked::RecorderThrottle(rate as u64))
            }
            other => Err(format!(
                "a fault's target is source or recorder here, not {other:?} (builders and links: not yet)"
            )),
        }
    }

    pub fn duration(&self) -> Duration {
        Duration::from_secs(self.seconds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(target: &str, id: Option<u32>, kind: &str, seconds: u64, value: Option<f64>) -> Fault {
        Fault {
            target: target.into(),
            id,
            kind: kind.into(),
            seconds,
            value,
        }
    }

    #[test]
    fn faults_are_checked_before_anything_happens() {
        assert_eq!(
            f("source", Some(5), "skip", 10, None).check(),
            Ok(Checked::Source(
                5,
                tessera_source::SourceFault::Inject(InjectKind::Skip)
            ))
        );
        assert_eq!(
            f("source", Some(1), "delay", 10, Some(20.0)).check(),
            Ok(Checked::Source(
                1,
                tessera_source::SourceFault::Delay(Duration::from_millis(20))
            ))
        );
        assert_eq!(
            f("recorder", None, "throttle", 5, Some(5e6)).check(),
            Ok(Checked::RecorderThrottle(5_000_000))
        );
        for (bad, why) in [
            (f("source", Some(1), "skip", 0, None), "seconds"),
            (f("source", Some(1), "skip", 601, None), "seconds"),
            (f("source", None, "skip", 10, None), "names its source"),
            (f("source", Some(1), "melt", 10, None), "not \"melt\""),
            (f("source", Some(1), "delay", 10, None), "milliseconds"),
            (f("source", Some(1), "delay", 10, Some(0.0)), "not from 1"),
            (f("recorder", None, "throttle", 10, Some(10.0)), "at least"),
            (
                f("recorder", None, "throttle", 10, Some(f64::NAN)),
                "at least",
            ),
            (f("recorder", None, "skip", 10, None), "throttle"),
            (f("builder", Some(0), "freeze", 10, None), "not yet"),
        ] {
            let e = bad.check().unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }
}

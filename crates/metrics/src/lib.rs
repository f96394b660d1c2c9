//! The OpenMetrics encoding of a run's live counters (`tessera_` names, a `host` label on every
//! series), shared by the run control's `/metrics` and each node agent's: the series are read
//! from a [`Live`] snapshot, so there is no second set of counters to keep in step.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeCounterValue, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use tessera_run::live::{Live, LiveHistogram};

pub type Labels = Vec<(&'static str, String)>;

/// This machine's name (the kernel's), or `unknown`.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// The content type of OpenMetrics text, what [`render_part`] writes.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The content type of the Prometheus text format 0.0.4.
pub const TEXT_0_0_4: &str = "text/plain; version=0.0.4; charset=utf-8";

/// `/metrics` as the client asked for it: OpenMetrics when its `Accept` names it (Prometheus
/// does, first), else the Prometheus text format 0.0.4 that `curl`, `promtool check metrics`
/// and older scrapers read. The two differ for counters (OpenMetrics names the family without
/// `_total`, its samples with it; 0.0.4 names both with it), in `# UNIT` and in the closing
/// `# EOF`; the samples are the same.
pub fn negotiate(openmetrics: String, accept: Option<&str>) -> (&'static str, String) {
    if accept.is_some_and(|a| a.contains("application/openmetrics-text")) {
        return (OPENMETRICS, openmetrics);
    }
    (TEXT_0_0_4, to_text_0_0_4(&openmetrics))
}

/// OpenMetrics text as the Prometheus text format 0.0.4.
fn to_text_0_0_4(om: &str) -> String {
    // Families typed `counter`: their HELP and TYPE lines take the samples' `_total` name.
    let counters: std::collections::HashSet<&str> = om
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(om.len());
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((p, rest)) => {
                let name = rest.split(' ').next().unwrap_or_default();
                if counters.contains(name) && !name.ends_with("_total") {
                    out.push_str(p);
                    out.push_str(name);
                    out.push_str("_total");
                    out.push_str(&rest[name.len()..]);
                } else {
                    out.push_str(line);
                }
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

pub struct Enc<'a, 'b> {
    pub d: &'a mut DescriptorEncoder<'b>,
    pub hosts: Hosts,
}

/// Where each component runs, for the `host` label.
pub struct Hosts {
    here: String,
    readout_units: std::collections::HashMap<String, String>,
    builders: std::collections::HashMap<String, String>,
    recorder: Option<String>,
}

impl Hosts {
    /// The hosts of `live`'s components; `here` for every other series.
    pub fn of(here: String, live: Option<&Live>) -> Hosts {
        let mut h = Hosts {
            here,
            readout_units: Default::default(),
            builders: Default::default(),
            recorder: None,
        };
        if let Some(l) = live {
            for u in &l.readout_units {
                if let Some(x) = &u.host {
                    h.readout_units.insert(u.id.to_string(), x.clone());
                }
            }
            for b in &l.builders {
                if let Some(x) = &b.host {
                    h.builders.insert(b.id.to_string(), x.clone());
                }
            }
            h.recorder = l.recorder.as_ref().and_then(|r| r.host.clone());
        }
        h
    }

    /// `labels` with the host of the component they name (this machine's if none).
    fn place(&self, name: &str, labels: &Labels) -> Labels {
        let mut l = labels.clone();
        if l.iter().any(|(k, _)| *k == "host") {
            return l;
        }
        let find = |key: &str, map: &std::collections::HashMap<String, String>| {
            labels
                .iter()
                .find(|(k, _)| *k == key)
                .and_then(|(_, v)| map.get(v).cloned())
        };
        let host = find("readout_unit", &self.readout_units)
            .or_else(|| find("builder", &self.builders))
            .or_else(|| {
                // The shipper runs beside the recorder's data directory.
                self.recorder.clone().filter(|_| {
                    name.starts_with("tessera_recorder") || name.starts_with("tessera_shipper")
                })
            })
            .unwrap_or_else(|| self.here.clone());
        l.push(("host", host));
        l
    }
}

impl Enc<'_, '_> {
    pub fn counter<N: EncodeCounterValue + std::fmt::Debug + Copy>(
        &mut self,
        name: &str,
        help: &str,
        v: &[(Labels, N)],
    ) -> std::fmt::Result {
        if v.is_empty() {
            return Ok(());
        }
        let mut d = self
            .d
            .encode_descriptor(name, help, None, MetricType::Counter)?;
        for (l, x) in v {
            ConstCounter::new(*x).encode(d.encode_family(&self.hosts.place(name, l))?)?;
        }
        Ok(())
    }

    pub fn gauge(&mut self, name: &str, help: &str, v: &[(Labels, f64)]) -> std::fmt::Result {
        if v.is_empty() {
            return Ok(());
        }
        let mut d = self
            .d
            .encode_descriptor(name, help, None, MetricType::Gauge)?;
        for (l, x) in v {
            ConstGauge::new(*x).encode(d.encode_family(&self.hosts.place(name, l))?)?;
        }
        Ok(())
    }

    pub fn histogram(
        &mut self,
        name: &str,
        help: &str,
        v: &[(Labels, &LiveHistogram)],
    ) -> std::fmt::Result {
        if v.is_empty() {
            return Ok(());
        }
        let mut d = self
            .d
            .encode_descriptor(name, help, None, MetricType::Histogram)?;
        for (l, h) in v {
            // The encoder takes per-bucket counts and f64::MAX for the +Inf bound.
            let mut prev = 0;
            let buckets: Vec<(f64, u64)> = h
                .buckets
                .iter()
                .map(|(le, cum)| {
                    let n = cum - prev;
                    prev = *cum;
                    (le.unwrap_or(f64::MAX), n)
                })
                .collect();
            d.encode_family(&self.hosts.place(name, l))?
                .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                    h.sum_s, h.count, &buckets, None,
                )?;
        }
        Ok(())
    }
}

/// A log2 histogram of integers (bin `i` holds `[2^(i-1), 2^i - 1]`) as Prometheus buckets
/// (`le` inclusive), values scaled by `scale` (ns to seconds).
fn log2_as_live(h: &tessera_run::live::Histogram, scale: f64) -> LiveHistogram {
    let mut cum = 0;
    let mut buckets: Vec<(Option<f64>, u64)> = h
        .bins
        .iter()
        .enumerate()
        .map(|(i, n)| {
            cum += n;
            let le = if i == 0 {
                0.0
            } else {
                (2f64.powi(i as i32) - 1.0) * scale
            };
            (Some(le), cum)
        })
        .collect();
    buckets.push((None, h.count));
    LiveHistogram {
        buckets,
        sum_s: h.sum * scale,
        count: h.count,
    }
}

pub fn l1(k: &'static str, v: impl ToString) -> Labels {
    vec![(k, v.to_string())]
}

/// Every component's series of `live`.
pub fn live_series(e: &mut Enc<'_, '_>, live: &Live) -> std::fmt::Result {
    e.gauge(
        "tessera_run_elapsed_seconds",
        "time since the open run started",
        &[(vec![], live.elapsed_s)],
    )?;

    // The trigger: every offered trigger accepted or vetoed (BUSY).
    if let Some(t) = &live.trigger {
        let p = || vec![("policy", t.policy.clone())];
        e.counter(
            "tessera_trigger_offered",
            "triggers the emulated sources' trigger offered",
            &[(p(), t.offered)],
        )?;
        e.counter(
            "tessera_trigger_accepted",
            "triggers taken: events every emulated source sends",
            &[(p(), t.accepted)],
        )?;
        e.counter(
            "tessera_trigger_vetoed",
            "triggers not taken because the system was BUSY (dead time)",
            &[(p(), t.vetoed)],
        )?;
    }

    // Sources.
    let src = |s: &tessera_run::live::LiveSource| -> Labels {
        vec![
            ("source", s.id.to_string()),
            ("readout_unit", s.readout_unit.to_string()),
        ]
    };
    e.counter(
        "tessera_source_fragments",
        "fragments read from each source's link (good or rejected at the wire)",
        &live
            .sources
            .iter()
            .map(|s| (src(s), s.received))
            .collect::<Vec<_>>(),
    )?;
    e.counter(
        "tessera_source_bytes",
        "bytes each emulated source put on the wire",
        &live
            .sources
            .iter()
            .filter_map(|s| Some((src(s), s.bytes_sent?)))
            .collect::<Vec<_>>(),
    )?;
    e.counter(
        "tessera_source_dead_time_seconds",
        "time each emulated source was held by back-pressure (dead time)",
        &live
            .sources
            .iter()
            .filter_map(|s| Some((src(s), s.held_ns? as f64 * 1e-9)))
            .collect::<Vec<_>>(),
    )?;
    let mut rejected = Vec::new();
    // The total by reason carries every reason a readout link can reject for, at 0 until the
    // first: a series that appears only with its first count hides that first count from
    // `increase()`. Per link, only reasons seen are listed: every reason for every one of
    // hundreds of links is series nobody reads.
    let mut by_reason: std::collections::BTreeMap<String, u64> = if live.sources.is_empty() {
        Default::default()
    } else {
        tessera_readout::Rejection::labels()
            .map(|r| (r.to_string(), 0))
            .collect()
    };
    for s in &live.sources {
        for (reason, n) in &s.rejected {
            let mut l = src(s);
            l.push(("reason", reason.clone()));
            rejected.push((l, *n));
            *by_reason.entry(reason.clone()).or_default() += n;
        }
    }
    e.counter(
        "tessera_source_skipped_bytes",
        "bytes each readout link skipped while resynchronising after bad data",
        &live
            .sources
            .iter()
            .map(|s| (src(s), s.skipped_bytes))
            .collect::<Vec<_>>(),
    )?;
    e.counter(
        "tessera_source_bytes_after_end",
        "bytes each source sent after its end of stream (a protocol error)",
        &live
            .sources
            .iter()
            .map(|s| (src(s), s.bytes_after_end))
            .collect::<Vec<_>>(),
    )?;
    e.counter(
        "tessera_source_rejected_fragments",
        "fragments each readout link rejected, by reason",
        &rejected,
    )?;
    e.counter(
        "tessera_rejected_fragments",
        "fragments rejected over all links, by reason",
        &by_reason
            .into_iter()
            .map(|(r, n)| (l1("reason", r), n))
            .collect::<Vec<_>>(),
    )?;
    e.gauge(
        "tessera_source_last_event_id",
        "event ID of each link's last good fragment (alignment across sources)",
        &live
            .sources
            .iter()
            .filter_map(|s| Some((src(s), s.last_event_id? as f64)))
            .collect::<Vec<_>>(),
    )?;

    // Readout units.
    let ru = |id: u32| l1("readout_unit", id);
    let rus = &live.readout_units;
    e.counter(
        "tessera_readout_fragments",
        "fragments each readout unit sent to builders",
        &rus.iter()
            .map(|u| (ru(u.id), u.fragments_forwarded))
            .collect::<Vec<_>>(),
    )?;
    e.counter(
        "tessera_readout_bytes",
        "bytes each readout unit sent to builders",
        &rus.iter()
            .map(|u| (ru(u.id), u.bytes_forwarded))
            .collect::<Vec<_>>(),
    )?;
    e.gauge(
        "tessera_readout_buffer_bytes",
        "buffer each readout unit holds now",
        &rus.iter()
            .map(|u| (ru(u.id), u.buffer_used as f64))
            .collect::<Vec<_>>(),
    )?;
    e.gauge(
        "tessera_readout_buffer_limit_bytes",
        "buffer bound of each readout unit",
        &rus.iter()
            .map(|u| (ru(u.id), u.buffer_limit as f64))
            .collect::<Vec<_>>(),
    )?;
    e.gauge(
        "tessera_readout_buffer_occupancy",
        "fraction of each readout unit's buffer in use",
        &rus.iter()
            .map(|u| {
                (
                    ru(u.id),
                    u.buffer_used as f64 / u.buffer_limit.max(1) as f64,
                )
            })
            .collect::<Vec<_>>(),
    )?;
    e.gauge(
        "tessera_readout_send_queued_bytes",
        "bytes each readout unit's links to builders had written and the network had not yet taken (the kernel's send queues), as last sampled; push mode",
        &rus.iter()
            .map(|u| (ru(u.id), u.send_queued as f64))
            .collect::<Vec<_>>(),
    )?;
    e.counter(
        "tessera_readout_busy_seconds",
        "time links of each readout unit could not read for lack of buffer, summed over links",
        &rus.iter()
            .map(|u| (ru(u.id), u.busy_ns as f64 * 1e-9))
            .collect::<Vec<_>>(),
    )?;
    e.gauge(
        "tessera_readout_busy",
        "1 while the readout unit asserts BUSY",
        &rus.iter()
            .map(|u| (ru(u.id), u.busy as u8 as f64))
            .collect::<Vec<_>>(),
    )?;

    // Builders.
    let bu = |id: u16| l1("builder", id);
    let bus = &live.builders;
    let mut events = Vec::new();
    for b in bus {
        for (outcome, n) in [
            ("complete", b.events_complete),
            ("incomplete", b.events_incomplete),
            ("rejected", b.events_rejected),
        ] {
            events.push((
                vec![
                    ("builder", b.id.to_string()),
                    ("outcome", outcome.to_string()),
                ],
                n,
            ));
        }
    }
    e.counter(
        "tessera_builder_events",
        "events each builder built, by outcome (rejected: by the filter)",
        &events,
    )?;
    e.counter(
        "tessera_incomplete_events",
        "events built with a source missing, over all builders",
        &[(vec![], bus.iter().map(|b| b.events_incomplete).sum::<u64>())],
    )?;
    e.counter(
        "tessera_builder_stall_releases",
        "incomplete events each builder let go to end a stand-still: every link held for memory by open events waiting on each other for a whole event timeout",
        &bus.iter()
            .map(|b| (bu(b.id), b.stall_releases))
            .collect::<Vec<_>>(),
    )?;
    e.counter(
        "tessera_builder_overdue_requests",
        "request mode: requests a readout unit left unanswered for a whole builder timeout after answering a later request of the same sources (request-protocol 4.3, rule 4), each event built without that unit's sources",
        &bus.iter()
            .map(|b| (bu(b.id), b.overdue_requests))
            .collect::<Vec<_>>(),
    )?;
    e.counter(
        "tessera_builder_dropped_fragments",
        "fragments each builder dropped, by the accounting's reason (late_at_builder, duplicate_at_builder, malformed_super_fragment, recorder_link_lost)",
        &bus.iter()
            .flat_map(|b| {
                b.dropped.iter().map(|(r, n)| {
                    (
                        vec![("builder", b.id.to_string()), ("reason", r.clone())],
                        *n,
                    )
                })
            })
            .collect::<Vec<_>>(),
    )?;
    e.counter(
        "tessera_builder_missing_source_events",
        "events each builder built without a source, by source ID (the sources named missing in its incomplete events)",
        &bus.iter()
            .flat_map(|b| {
                b.missing_by_source.iter().map(|(src, n)| {
                    (
                        vec![("builder", b.id.to_string()), ("source", src.to_string())],
                        *n,
                    )
                })
            })
            .collect::<Vec<_>>(),
    )?;
    e.counter(
        "tessera_builder_bytes",
        "bytes of events each builder built",
        &bus.iter()
            .map(|b| (bu(b.id), b.bytes_built))
            .collect::<Vec<_>>(),
    )?;
    e.gauge(
        "tessera_builder_buffer_occupancy",
        "fraction of each builder's buffer in use",
        &bus.iter()
            .map(|b| {
                (
                    bu(b.id),
                    b.buffer_used as f64 / b.buffer_limit.max(1) as f64,
                )
            })
            .collect::<Vec<_>>(),
    )?;
    e.gauge(
        "tessera_builder_receive_queued_bytes",
        "bytes arrived on each builder's links from readout units and not yet read (the kernel's receive queues), as last sampled; push mode",
        &bus.iter()
            .map(|b| (bu(b.id), b.receive_queued as f64))
            .collect::<Vec<_>>(),
    )?;
    e.counter(
        "tessera_builder_busy_seconds",
        "time links of each builder could not read for lack of buffer, summed over links",
        &bus.iter()
            .map(|b| (bu(b.id), b.busy_ns as f64 * 1e-9))
            .collect::<Vec<_>>(),
    )?;
    e.gauge(
        "tessera_builder_pending_events",
        "events each builder is assembling",
        &bus.iter()
            .map(|b| (bu(b.id), b.pending_events as f64))
            .collect::<Vec<_>>(),
    )?;
    e.histogram(
        "tessera_builder_event_latency_seconds",
        "time from an event's first part at the builder to its build",
        &bus.iter()
            .map(|b| (bu(b.id), &b.latency))
            .collect::<Vec<_>>(),
    )?;

    // The recorder's histograms: event size and time between triggers as Prometheus
    // histograms; per source only the means (one series each, not one per bin and source).
    if let Some(h) = live.recorder.as_ref().and_then(|r| r.histograms.as_ref()) {
        e.histogram(
            "tessera_event_size_bytes",
            "record bytes of each event the recorder took",
            &[(vec![], &log2_as_live(&h.event_size, 1.0))],
        )?;
        e.histogram(
            "tessera_time_between_triggers_seconds",
            "time between the triggers of consecutive event IDs (their timestamps)",
            &[(vec![], &log2_as_live(&h.time_between_triggers, 1e-9))],
        )?;
        e.gauge(
            "tessera_fragment_size_mean_bytes",
            "mean payload bytes of each source's fragments this run",
            &h.fragment_size
                .iter()
                .filter_map(|(s, x)| Some((l1("source", s), x.mean()?)))
                .collect::<Vec<_>>(),
        )?;
        e.gauge(
            "tessera_payload_word_mean",
            "mean of the configured payload word ([histograms]) of each source's fragments this run",
            &h.payload_word
                .iter()
                .filter_map(|(s, x)| Some((l1("source", s), x.mean()?)))
                .collect::<Vec<_>>(),
        )?;
        e.counter(
            "tessera_recorded_events_by_stream",
            "events the recorder took, by the stream written to (recorder.streams; main for the rest)",
            &h.streams
                .iter()
                .map(|(t, n)| (l1("stream", t), *n))
                .collect::<Vec<_>>(),
        )?;
        e.counter(
            "tessera_recorded_events_by_trigger_type",
            "events the recorder took, by trigger type",
            &h.trigger_types
                .iter()
                .map(|(t, n)| (l1("trigger_type", t), *n))
                .collect::<Vec<_>>(),
        )?;
    }

    // Recorder.
    if let Some(r) = &live.recorder {
        e.counter(
            "tessera_recorder_events",
            "events the recorder received",
            &[(vec![], r.events)],
        )?;
        e.counter(
            "tessera_recorder_bytes",
            "bytes the recorder took in (record) and wrote to files (file, after compression)",
            &[
                (l1("kind", "record"), r.record_bytes),
                (l1("kind", "file"), r.file_bytes),
            ],
        )?;
        e.counter(
            "tessera_recorder_second_copy_fragments",
            "fragments in second copies of events the recorder dropped (request mode, after a failover; each event is written once)",
            &[(vec![], r.second_copy_fragments)],
        )?;
        e.counter(
            "tessera_recorder_files",
            "files the recorder finished",
            &[(vec![], r.files)],
        )?;
        e.gauge(
            "tessera_recorder_buffer_occupancy",
            "fraction of the recorder's buffer in use",
            &[(vec![], r.buffer_used as f64 / r.buffer_limit.max(1) as f64)],
        )?;
        e.counter(
            "tessera_recorder_write_seconds",
            "time the recorder spent in write and fsync calls",
            &[(vec![], r.write_ns as f64 * 1e-9)],
        )?;
        e.gauge(
            "tessera_recorder_disk_free_bytes",
            "free bytes on the output file system at the recorder's last look",
            &[(vec![], r.disk_free as f64)],
        )?;
        e.gauge(
                "tessera_recorder_disk_alarm",
                "1 below the soft free-space watermark (writes slowed), 2 below the hard one (the run stops), else 0",
                &[(vec![], if r.disk_full { 2.0 } else if r.disk_low { 1.0 } else { 0.0 })],
            )?;
    }

    Ok(())
}

/// The shipper's backlog and its work since it started.
pub fn shipper_series(
    e: &mut Enc<'_, '_>,
    s: &tessera_run::live::ShipperStatus,
) -> std::fmt::Result {
    e.gauge(
        "tessera_shipper_backlog_files",
        "finished files not yet verified at every destination",
        &[(vec![], s.backlog_files as f64)],
    )?;
    e.gauge(
        "tessera_shipper_backlog_bytes",
        "bytes of finished files not yet verified at every destination",
        &[(vec![], s.backlog_bytes as f64)],
    )?;
    e.gauge(
        "tessera_shipper_oldest_seconds",
        "age of the oldest file not yet verified at every destination",
        &[(vec![], s.oldest_s)],
    )?;
    e.gauge(
        "tessera_shipper_rate_bytes_per_second",
        "bytes per second verified in the last pass that copied anything",
        &[(vec![], s.rate_bytes_per_s)],
    )?;
    if let Some(d) = s.drain_s {
        e.gauge(
            "tessera_shipper_drain_seconds",
            "time to drain the backlog at the last rate",
            &[(vec![], d)],
        )?;
    }
    e.counter(
        "tessera_shipper_copies",
        "copies made (copied), read back and found whole (verified), failed, and local files deleted once safe (deleted), since the shipper started",
        &[
            (l1("result", "copied"), s.copied),
            (l1("result", "verified"), s.verified),
            (l1("result", "failed"), s.failed),
            (l1("result", "deleted"), s.deleted),
        ],
    )
}

/// A node agent's own series and its part of the run.
#[derive(Debug)]
struct Part {
    here: String,
    gauges: Vec<(&'static str, &'static str, f64)>,
    live: Option<Live>,
    shipper: Option<tessera_run::live::ShipperStatus>,
}

impl Collector for Part {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut e = Enc {
            d: &mut encoder,
            hosts: Hosts::of(self.here.clone(), self.live.as_ref()),
        };
        for (name, help, v) in &self.gauges {
            e.gauge(name, help, &[(vec![], *v)])?;
        }
        if let Some(s) = &self.shipper {
            shipper_series(&mut e, s)?;
        }
        if let Some(live) = &self.live {
            live_series(&mut e, live)?;
        }
        Ok(())
    }
}

/// OpenMetrics text of one host (`here`, its `host` label): `gauges` of its own, its shipper's
/// series where it runs one, then every series of its part of the run, if one is open.
pub fn render_part(
    here: &str,
    gauges: Vec<(&'static str, &'static str, f64)>,
    live: Option<Live>,
    shipper: Option<tessera_run::live::ShipperStatus>,
) -> String {
    let mut reg = Registry::default();
    reg.register_collector(Box::new(Part {
        here: here.to_string(),
        gauges,
        live,
        shipper,
    }));
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &reg);
    out
}

#[cfg(test)]
mod tests {
    use tessera_run::live::{Live, LiveBuilder, LiveHistogram, LiveRecorder};

    /// The text format 0.0.4 names a counter's HELP and TYPE with `_total`, as its samples,
    /// and has no `# EOF` or `# UNIT`; OpenMetrics is served as it is to a client that asks.
    #[test]
    fn the_text_format_is_served_unless_openmetrics_is_asked_for() {
        let om = "# HELP tessera_state the state\n# TYPE tessera_state gauge\ntessera_state{state=\"running\"} 1\n\
                  # HELP tessera_builder_events events built\n# TYPE tessera_builder_events counter\n# UNIT tessera_builder_events events\n\
                  tessera_builder_events_total{outcome=\"complete\"} 5\n# EOF\n";
        let (ct, text) = super::negotiate(om.to_string(), Some("*/*"));
        assert_eq!(ct, super::TEXT_0_0_4);
        assert_eq!(
            text,
            "# HELP tessera_state the state\n# TYPE tessera_state gauge\ntessera_state{state=\"running\"} 1\n\
             # HELP tessera_builder_events_total events built\n# TYPE tessera_builder_events_total counter\n\
             tessera_builder_events_total{outcome=\"complete\"} 5\n"
        );
        assert_eq!(super::negotiate(om.to_string(), None).0, super::TEXT_0_0_4);
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert_eq!(
            super::negotiate(om.to_string(), Some(prometheus)),
            (super::OPENMETRICS, om.to_string())
        );
    }

    /// Every fragment a builder drops is a series by reason, and the recorder's dropped second
    /// copies one of their own: an operator can alarm on late fragments without the report. The
    /// sources named missing in incomplete events are series by source.
    #[test]
    fn dropped_fragments_are_series_by_reason() {
        let mut live = Live::empty(7);
        live.builders.push(LiveBuilder {
            id: 3,
            host: None,
            events_complete: 0,
            events_incomplete: 0,
            events_rejected: 0,
            bytes_built: 0,
            buffer_used: 0,
            buffer_limit: 1,
            busy_ns: 0,
            links: 0,
            pending_events: 0,
            queued_fragments: 0,
            latency: LiveHistogram {
                buckets: Vec::new(),
                sum_s: 0.0,
                count: 0,
            },
            receive_queued: 0,
            stall_releases: 0,
            overdue_requests: 0,
            dropped: [
                ("late_at_builder".to_string(), 5),
                ("recorder_link_lost".to_string(), 2),
            ]
            .into_iter()
            .collect(),
            missing_by_source: [(5, 1602)].into_iter().collect(),
        });
        live.recorder = Some(LiveRecorder {
            second_copy_fragments: 12,
            ..Default::default()
        });
        let m = super::render_part("h", Vec::new(), Some(live), None);
        for want in [
            r#"tessera_builder_dropped_fragments_total{builder="3",reason="late_at_builder",host="h"} 5"#,
            r#"tessera_builder_dropped_fragments_total{builder="3",reason="recorder_link_lost",host="h"} 2"#,
            r#"tessera_recorder_second_copy_fragments_total{host="h"} 12"#,
            r#"tessera_builder_missing_source_events_total{builder="3",source="5",host="h"} 1602"#,
        ] {
            assert!(m.contains(want), "{want} not in:\n{m}");
        }
    }
}

//! `/metrics`: every component's counters in the OpenMetrics text format, names prefixed
//! `tessera_`. Read at scrape time from the open run's atomics (no second set of counters to
//! keep in step); rates and fractions over the last sampling interval come from the sampler,
//! for dashboards that do not compute `rate()` themselves.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::registry::Registry;

use tessera_metrics::{l1, Enc, Hosts};
use tessera_run::live::Live;

use crate::controller::Controller;
use crate::sampler::Rates;
use crate::state::State;

#[derive(Debug)]
struct Snapshot {
    alarms: Vec<(&'static str, String)>,
    raised: Vec<(&'static str, u64)>,
    state: State,
    run_number: Option<u64>,
    live: Option<Live>,
    rates: Option<Rates>,
    /// Vetoed triggers of the open run by the bottleneck named when they were vetoed.
    vetoed_by: std::collections::BTreeMap<String, u64>,
    /// The shipper's, between runs too.
    shipper: Option<tessera_run::live::ShipperStatus>,
}

/// The metrics of `c` now, as OpenMetrics text.
pub fn render(c: &Controller) -> String {
    let view = c.view();
    let live = c.session().map(|s| s.live());
    let (rates, vetoed_by) = {
        let s = c.shared.sampler.lock();
        (s.rates.clone(), s.vetoed_by(0))
    };
    // Every series names the host it comes from (one Prometheus scrapes every host of a run):
    // over hosts, a component's series the host the component runs on.
    let mut reg = Registry::default();
    let (alarms, raised) = {
        let a = c.shared.alarms.lock();
        (
            a.active().map(|x| (x.alarm, x.subject.clone())).collect(),
            crate::alarms::kind::ALL
                .iter()
                .map(|k| (*k, a.raised_total().get(k).copied().unwrap_or(0)))
                .collect(),
        )
    };
    let shipper = live
        .as_ref()
        .and_then(|l| l.shipper.clone())
        .or_else(|| c.shipper().map(|s| s.status()));
    reg.register_collector(Box::new(Snapshot {
        shipper,
        alarms,
        raised,
        state: view.state,
        run_number: view.run_number,
        rates: live.as_ref().and(rates),
        vetoed_by,
        live,
    }));
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &reg);
    out
}

pub use tessera_metrics::host_name;

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut e = Enc {
            d: &mut encoder,
            hosts: Hosts::of(host_name(), self.live.as_ref()),
        };
        let states = [
            State::Initial,
            State::Configured,
            State::Running,
            State::Paused,
            State::Stopped,
            State::Error,
        ];
        e.gauge(
            "tessera_state",
            "1 for the run control's current state, 0 for the others",
            &states
                .iter()
                .map(|s| (l1("state", s.name()), (*s == self.state) as u8 as f64))
                .collect::<Vec<_>>(),
        )?;
        e.gauge(
            "tessera_alarm_active",
            "1 for each alarm raised now (alarm: its kind; subject: what it is about)",
            &self
                .alarms
                .iter()
                .map(|(a, s)| (vec![("alarm", a.to_string()), ("subject", s.clone())], 1.0))
                .collect::<Vec<_>>(),
        )?;
        e.counter(
            "tessera_alarms_raised",
            "alarms raised since the run control started, by kind",
            &self
                .raised
                .iter()
                .map(|(a, n)| (l1("alarm", a), *n))
                .collect::<Vec<_>>(),
        )?;
        if let Some(n) = self.run_number {
            e.gauge(
                "tessera_run_number",
                "the open run, or the last one",
                &[(vec![], n as f64)],
            )?;
        }
        if let Some(s) = &self.shipper {
            tessera_metrics::shipper_series(&mut e, s)?;
        }
        let Some(live) = &self.live else {
            return Ok(());
        };
        tessera_metrics::live_series(&mut e, live)?;

        // Rates and fractions over the last sampling interval.
        if let Some(rt) = &self.rates {
            let ru = |id: u32| l1("readout_unit", id);
            let bu = |id: u16| l1("builder", id);
            e.gauge(
                "tessera_dead_time_fraction",
                "dead time over the last interval: with a veto the fraction of triggers vetoed, else the most-held emulated source's time held by back-pressure",
                &[(vec![], rt.dead_time_fraction)],
            )?;
            e.gauge(
                "tessera_run_dead_time_fraction",
                "dead time over the open run so far, by the rule of tessera_dead_time_fraction (the run report's dead_time_fraction)",
                &[(vec![], live.dead_time_fraction())],
            )?;
            if self.live.as_ref().is_some_and(|l| l.trigger.is_some()) {
                e.counter(
                    "tessera_trigger_vetoed_by_bottleneck",
                    "triggers vetoed in the open run, by the bottleneck named when they were (the stage that held the system BUSY)",
                    &self
                        .vetoed_by
                        .iter()
                        .map(|(k, n)| (l1("bottleneck", k), *n))
                        .collect::<Vec<_>>(),
                )?;
            }
            e.gauge(
                "tessera_source_fragments_per_second",
                "fragments per second read from each source's link, last interval",
                &rt.per_source_fragments_per_s
                    .iter()
                    .map(|(s, v)| (l1("source", s), *v))
                    .collect::<Vec<_>>(),
            )?;
            e.gauge(
                "tessera_source_dead_time_fraction",
                "fraction of the last interval each emulated source was held by back-pressure",
                &rt.per_source_dead_fraction
                    .iter()
                    .map(|(s, v)| (l1("source", s), *v))
                    .collect::<Vec<_>>(),
            )?;
            e.gauge(
                "tessera_readout_bytes_per_second",
                "bytes per second each readout unit sent, last interval",
                &rt.per_readout_bytes_per_s
                    .iter()
                    .map(|(s, v)| (ru(*s), *v))
                    .collect::<Vec<_>>(),
            )?;
            e.gauge(
                "tessera_readout_busy_fraction",
                "fraction of the last interval each readout unit's links could not read",
                &rt.per_readout_busy_fraction
                    .iter()
                    .map(|(s, v)| (ru(*s), *v))
                    .collect::<Vec<_>>(),
            )?;
            e.gauge(
                "tessera_builder_events_per_second",
                "events per second each builder built, last interval",
                &rt.per_builder_events_per_s
                    .iter()
                    .map(|(s, v)| (bu(*s), *v))
                    .collect::<Vec<_>>(),
            )?;
            e.gauge(
                "tessera_builder_bytes_per_second",
                "bytes per second each builder built, last interval",
                &rt.per_builder_bytes_per_s
                    .iter()
                    .map(|(s, v)| (bu(*s), *v))
                    .collect::<Vec<_>>(),
            )?;
            e.gauge(
                "tessera_builder_busy_fraction",
                "fraction of the last interval each builder's links could not read",
                &rt.per_builder_busy_fraction
                    .iter()
                    .map(|(s, v)| (bu(*s), *v))
                    .collect::<Vec<_>>(),
            )?;
            e.gauge(
                "tessera_recorder_busy_fraction",
                "fraction of the last interval the recorder's links could not read",
                &[(vec![], rt.recorder_busy_fraction)],
            )?;
            e.gauge(
                "tessera_stage_blocked",
                "1 for a stage held by the stage after it, last interval",
                &rt.stages
                    .iter()
                    .map(|s| {
                        let mut l = l1("stage", s.stage);
                        if let Some(h) = &s.host {
                            l.push(("host", h.clone()));
                        }
                        (l, (s.condition == "blocked") as u8 as f64)
                    })
                    .collect::<Vec<_>>(),
            )?;
        }
        Ok(())
    }
}

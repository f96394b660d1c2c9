//! The trigger schedule and per-fragment sizes, as pure functions of the shared seed. They are
//! written out here (splitmix64, inverse-CDF exponential, Box-Muller) rather than taken from a
//! random-number crate because every source, on every host and in every version, must derive the
//! same triggers; general-purpose generators do not promise a stable sequence.

use std::sync::Arc;
use tessera_config::TriggerMode;

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform number in (0, 1) from a hash.
fn unit(h: u64) -> f64 {
    ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// The trigger rate over the run: one rate, or a profile of points joined by steps or lines.
#[derive(Clone, Debug)]
pub struct RateProfile {
    /// (ns from the start, Hz), the first at 0.
    points: Vec<(f64, f64)>,
    linear: bool,
}

impl RateProfile {
    pub fn constant(hz: f64) -> RateProfile {
        RateProfile {
            points: vec![(0.0, hz)],
            linear: false,
        }
    }

    /// From `[seconds, Hz]` points (the first at 0); `linear` joins them by lines, else steps.
    pub fn points(points: &[[f64; 2]], linear: bool) -> RateProfile {
        RateProfile {
            points: points.iter().map(|p| (p[0] * 1e9, p[1])).collect(),
            linear,
        }
    }

    /// The rate at `t_ns`.
    pub fn at(&self, t_ns: f64) -> f64 {
        let i = self.points.partition_point(|p| p.0 <= t_ns).max(1) - 1;
        let (t0, r0) = self.points[i];
        match self.points.get(i + 1) {
            Some(&(t1, r1)) if self.linear => r0 + (r1 - r0) * (t_ns - t0) / (t1 - t0),
            _ => r0,
        }
    }

    /// The time from `t_ns` until `count` triggers are expected (the rate's integral), in ns:
    /// on a line, the root of r0 g + k g^2 / 2 = count, so a rising ramp is not undercounted
    /// by taking each gap at its start's rate.
    fn gap(&self, t_ns: f64, count: f64) -> f64 {
        let r0 = self.at(t_ns);
        let i = self.points.partition_point(|p| p.0 <= t_ns).max(1) - 1;
        let k = match self.points.get(i + 1) {
            Some(&(t1, r1)) if self.linear => (r1 - self.points[i].1) / (t1 - self.points[i].0),
            _ => 0.0,
        };
        let c = count * 1e9;
        if k.abs() < 1e-300 {
            return c / r0;
        }
        let disc = r0 * r0 + 2.0 * k * c;
        if disc <= 0.0 {
            // A falling line that reaches 0 before `count` triggers: the rate at the start.
            return c / r0;
        }
        (disc.sqrt() - r0) / k
    }

    /// The first time from `t_ns` on at which the rate is above 0, if any.
    fn next_live(&self, t_ns: f64) -> Option<f64> {
        if self.at(t_ns) > 0.0 {
            return Some(t_ns);
        }
        if !self.linear {
            return self
                .points
                .iter()
                .find(|p| p.0 > t_ns && p.1 > 0.0)
                .map(|p| p.0);
        }
        // A line rising from 0: the first millisecond at which it is above 0.
        let end = self.points.last().map_or(0.0, |p| p.0);
        let mut t = t_ns;
        while t <= end {
            t += 1e6;
            if self.at(t) > 0.0 {
                return Some(t);
            }
        }
        None
    }
}

/// What a schedule makes: offered triggers with their times in nanoseconds from the start of the
/// run (the index counts offered triggers; with a veto, accepted ones get the event IDs).
#[derive(Clone, Debug)]
pub enum ScheduleKind {
    Unlimited,
    Periodic(RateProfile),
    Poisson(RateProfile),
    /// Bursts starting periodically at the profile's rate, `size` triggers spread over
    /// `window_ns`.
    Bursts {
        rate: RateProfile,
        size: u32,
        window_ns: f64,
    },
    /// Given times, once.
    Scenario(Arc<[u64]>),
}

/// Offered triggers with their times, in order.
pub struct TriggerSchedule {
    kind: ScheduleKind,
    seed: u64,
    index: u64,
    t_ns: f64,
    last: u64,
}

impl TriggerSchedule {
    pub fn new(mode: TriggerMode, rate_hz: f64, seed: u64) -> Self {
        let rate = RateProfile::constant(rate_hz);
        let kind = match mode {
            TriggerMode::Unlimited => ScheduleKind::Unlimited,
            TriggerMode::Periodic => ScheduleKind::Periodic(rate),
            TriggerMode::Poisson => ScheduleKind::Poisson(rate),
            TriggerMode::Bursts => ScheduleKind::Bursts {
                rate,
                size: 1,
                window_ns: 0.0,
            },
            TriggerMode::Scenario => ScheduleKind::Scenario(Arc::from(Vec::new())),
        };
        Self::of(kind, seed)
    }

    /// The schedule `[sources]` describes; `scenario`: the times of a scenario file, read.
    pub fn from_settings(s: &tessera_config::SourcesSection, scenario: Option<Arc<[u64]>>) -> Self {
        let rate = if s.rate_profile.is_empty() {
            RateProfile::constant(s.rate_hz)
        } else {
            RateProfile::points(
                &s.rate_profile,
                s.rate_profile_shape == tessera_config::ProfileShape::Linear,
            )
        };
        let kind = match s.trigger {
            TriggerMode::Unlimited => ScheduleKind::Unlimited,
            TriggerMode::Periodic => ScheduleKind::Periodic(rate),
            TriggerMode::Poisson => ScheduleKind::Poisson(rate),
            TriggerMode::Bursts => ScheduleKind::Bursts {
                rate,
                size: s.burst_size.max(1),
                window_ns: s.burst_window_us * 1e3,
            },
            TriggerMode::Scenario => {
                ScheduleKind::Scenario(scenario.unwrap_or_else(|| Arc::from(Vec::new())))
            }
        };
        Self::of(kind, s.seed)
    }

    pub fn of(kind: ScheduleKind, seed: u64) -> Self {
        TriggerSchedule {
            kind,
            seed,
            index: 0,
            t_ns: 0.0,
            last: 0,
        }
    }

    /// Whether triggers come at times (all but unlimited).
    pub fn paced(&self) -> bool {
        !matches!(self.kind, ScheduleKind::Unlimited)
    }

    /// The next offered trigger: (index, time in ns), times never decreasing; `None` when a
    /// scenario has run out, or a rate profile stays at 0. Unlimited triggers all have time 0.
    pub fn next_trigger(&mut self) -> Option<(u64, u64)> {
        let i = self.index;
        let t = match &self.kind {
            ScheduleKind::Unlimited => 0.0,
            ScheduleKind::Scenario(times) => *times.get(i as usize)? as f64,
            ScheduleKind::Periodic(rate) => {
                let t = rate.next_live(self.t_ns)?;
                self.t_ns = t + rate.gap(t, 1.0);
                t
            }
            ScheduleKind::Poisson(rate) => {
                let t = rate.next_live(self.t_ns)?;
                let u = unit(splitmix(self.seed ^ splitmix(i.wrapping_add(0x7157))));
                self.t_ns = t + rate.gap(t, -u.ln());
                t
            }
            ScheduleKind::Bursts {
                rate,
                size,
                window_ns,
            } => {
                let size = u64::from(*size);
                let j = i % size;
                if j == 0 && i > 0 {
                    // The next burst starts one period after this one's start.
                    let start = self.t_ns;
                    let next = rate.next_live(start + rate.gap(start, 1.0))?;
                    self.t_ns = next;
                } else if i == 0 {
                    self.t_ns = rate.next_live(0.0)?;
                }
                self.t_ns + *window_ns * j as f64 / size as f64
            }
        };
        self.index += 1;
        let t = (t as u64).max(self.last);
        self.last = t;
        Some((i, t))
    }
}

/// Trigger type of an event: 1..=types, the same for every source.
pub fn trigger_type(seed: u64, event: u64, types: u16) -> u16 {
    1 + (splitmix(seed.rotate_left(17) ^ event) % types.max(1) as u64) as u16
}

/// Payload size of (source, event): `mean` when `spread` is 0, else normal(mean, spread) clamped
/// to [0, max].
pub fn payload_size(seed: u64, source: u32, event: u64, mean: u64, spread: u64, max: u64) -> u64 {
    Sizes {
        seed,
        mean,
        spread,
        max,
        correlation: 0.0,
        histogram: None,
    }
    .of(source, event)
}

/// How the emulated sources size their fragments: normal(mean, spread) or a histogram, each
/// source's draw correlated with the event's by `correlation` (a Gaussian copula: an event drawn
/// big is big at every source when it is 1).
#[derive(Clone, Copy, Debug)]
pub struct Sizes<'a> {
    pub seed: u64,
    pub mean: u64,
    pub spread: u64,
    pub max: u64,
    pub correlation: f64,
    pub histogram: Option<&'a tessera_config::SizeHistogram>,
}

impl Sizes<'_> {
    /// Inlined for the fixed size (every fragment of a run asks), the draw is not.
    #[inline]
    pub fn of(&self, source: u32, event: u64) -> u64 {
        if self.histogram.is_none() && self.spread == 0 {
            return self.mean.min(self.max);
        }
        self.drawn(source, event)
    }

    fn drawn(&self, source: u32, event: u64) -> u64 {
        // The draw of before correlations existed, so that a run without them is unchanged.
        let z_source = normal(splitmix(
            self.seed ^ splitmix(event ^ ((source as u64) << 44)),
        ));
        let z = if self.correlation > 0.0 {
            let z_event = normal(splitmix(self.seed.rotate_left(29) ^ splitmix(!event)));
            self.correlation.sqrt() * z_event + (1.0 - self.correlation).sqrt() * z_source
        } else {
            z_source
        };
        match self.histogram {
            Some(h) => h.quantile(normal_cdf(z)).min(self.max),
            None => (self.mean as f64 + z * self.spread as f64)
                .round()
                .clamp(0.0, self.max as f64) as u64,
        }
    }
}

/// A standard normal number from a hash (Box-Muller).
fn normal(h: u64) -> f64 {
    let (u1, u2) = (unit(h), unit(splitmix(h)));
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// The standard normal distribution function, from erf (Abramowitz and Stegun 7.1.26, error
/// below 1.5e-7: far finer than any size histogram's bins).
fn normal_cdf(z: f64) -> f64 {
    let x = z.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * x);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let erf = 1.0 - poly * (-x * x).exp();
    if z >= 0.0 {
        0.5 * (1.0 + erf)
    } else {
        0.5 * (1.0 - erf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_mean_gap_matches_rate() {
        let mut s = TriggerSchedule::new(TriggerMode::Poisson, 8000.0, 42);
        let mut last = 0;
        for _ in 0..100_000 {
            last = s.next_trigger().unwrap().1;
        }
        let mean_gap = last as f64 / 100_000.0;
        assert!((mean_gap - 125_000.0).abs() < 2_500.0, "{mean_gap}");
        // Same seed, same triggers.
        let a: Vec<_> = (0..10)
            .map({
                let mut s = TriggerSchedule::new(TriggerMode::Poisson, 10.0, 7);
                move |_| s.next_trigger()
            })
            .collect();
        let b: Vec<_> = (0..10)
            .map({
                let mut s = TriggerSchedule::new(TriggerMode::Poisson, 10.0, 7);
                move |_| s.next_trigger()
            })
            .collect();
        assert_eq!(a, b);
    }

    #[test]
    fn sizes_spread_and_clamp() {
        let v: Vec<u64> = (0..10_000)
            .map(|e| payload_size(1, 3, e, 1000, 300, 1500))
            .collect();
        let mean = v.iter().sum::<u64>() as f64 / v.len() as f64;
        assert!((mean - 1000.0).abs() < 20.0, "{mean}");
        assert!(v.iter().all(|&x| x <= 1500));
        assert!(v.iter().any(|&x| x != 1000));
        assert_eq!(payload_size(1, 3, 5, 1000, 0, 1500), 1000);
    }

    #[test]
    fn the_normal_distribution_function_is_close() {
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_cdf(1.0) - 0.841_344_746).abs() < 1e-6);
        assert!((normal_cdf(-1.96) - 0.024_997_895).abs() < 1e-6);
    }

    fn hist() -> tessera_config::SizeHistogram {
        tessera_config::parse_size_histogram("100 3\n5000 1\n").unwrap()
    }

    #[test]
    fn histogram_sizes_follow_the_weights() {
        let h = hist();
        let s = Sizes {
            seed: 7,
            mean: 0,
            spread: 0,
            max: 1 << 20,
            correlation: 0.0,
            histogram: Some(&h),
        };
        let big = (0..20_000).filter(|&e| s.of(2, e) == 5000).count() as f64 / 20_000.0;
        assert!((big - 0.25).abs() < 0.02, "{big}");
        assert!((0..1000).all(|e| matches!(s.of(2, e), 100 | 5000)));
    }

    #[test]
    fn correlated_sizes_make_an_event_big_everywhere() {
        let h = hist();
        let sizes = |correlation| Sizes {
            seed: 7,
            mean: 0,
            spread: 0,
            max: 1 << 20,
            correlation,
            histogram: Some(&h),
        };
        // How often sources 0 and 1 agree on a big event.
        let both_big = |s: &Sizes| {
            (0..20_000)
                .filter(|&e| s.of(0, e) == 5000 && s.of(1, e) == 5000)
                .count() as f64
                / 20_000.0
        };
        let independent = both_big(&sizes(0.0));
        assert!((independent - 0.0625).abs() < 0.01, "{independent}");
        let fully = sizes(1.0);
        assert!((0..1000).all(|e| fully.of(0, e) == fully.of(9, e)));
        assert!((both_big(&fully) - 0.25).abs() < 0.02);
        let partly = both_big(&sizes(0.6));
        assert!(partly > independent + 0.05 && partly < 0.25, "{partly}");
    }
}

#[cfg(test)]
mod shapes {
    use super::*;

    fn times(kind: ScheduleKind, n: usize) -> Vec<u64> {
        let mut s = TriggerSchedule::of(kind, 1);
        (0..n)
            .map_while(|_| s.next_trigger().map(|x| x.1))
            .collect()
    }

    #[test]
    fn bursts_put_their_triggers_within_the_window_and_start_at_the_rate() {
        let t = times(
            ScheduleKind::Bursts {
                rate: RateProfile::constant(100.0),
                size: 9,
                window_ns: 180_000.0,
            },
            27,
        );
        assert_eq!(
            &t[..9],
            &[0, 20_000, 40_000, 60_000, 80_000, 100_000, 120_000, 140_000, 160_000]
        );
        assert_eq!(t[9], 10_000_000);
        assert_eq!(t[18], 20_000_000);
        assert_eq!(t[26], 20_160_000);
    }

    #[test]
    fn a_scenario_replays_its_times_once() {
        let t = times(ScheduleKind::Scenario(Arc::from(vec![5, 7, 1_000])), 10);
        assert_eq!(t, vec![5, 7, 1_000]);
    }

    #[test]
    fn rate_steps_and_lines_set_the_gaps() {
        // 1 kHz for 1 s, then 0 for 1 s, then 10 kHz.
        let p = RateProfile::points(&[[0.0, 1000.0], [1.0, 0.0], [2.0, 10_000.0]], false);
        let t = times(ScheduleKind::Periodic(p), 1_010);
        assert_eq!(t[1] - t[0], 1_000_000);
        assert_eq!(t[999], 999_000_000);
        assert_eq!(
            t[1000], 2_000_000_000,
            "the step to 0 holds the triggers until 2 s"
        );
        assert_eq!(t[1001] - t[1000], 100_000);
        // A line from 0 to 2 kHz over 1 s: about 1 000 triggers in that second.
        let p = RateProfile::points(&[[0.0, 0.0], [1.0, 2000.0]], true);
        let mut s = TriggerSchedule::of(ScheduleKind::Periodic(p), 1);
        let n = std::iter::from_fn(|| s.next_trigger())
            .take_while(|x| x.1 < 1_000_000_000)
            .count();
        assert!((900..=1_000).contains(&n), "{n}");
        // All zero after the last point: no more triggers.
        let p = RateProfile::points(&[[0.0, 1000.0], [0.01, 0.0]], false);
        assert_eq!(times(ScheduleKind::Periodic(p), 100).len(), 10);
    }
}

//! The trigger schedule and per-fragment sizes, as pure functions of the shared seed. They are
//! written out here (splitmix64, inverse-CDF exponential, Box-Muller) rather than taken from a
//! random-number crate because every source, on every host and in every version, must derive the
//! same triggers; general-purpose generators do not promise a stable sequence.

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

/// Event IDs with their trigger times in nanoseconds from the start of the run.
pub struct TriggerSchedule {
    mode: TriggerMode,
    period_ns: f64,
    seed: u64,
    event: u64,
    t_ns: f64,
}

impl TriggerSchedule {
    pub fn new(mode: TriggerMode, rate_hz: f64, seed: u64) -> Self {
        let period_ns = if rate_hz > 0.0 { 1e9 / rate_hz } else { 0.0 };
        TriggerSchedule {
            mode,
            period_ns,
            seed,
            event: 0,
            t_ns: 0.0,
        }
    }

    /// The next trigger: (event ID, time in ns). Unlimited triggers all have time 0.
    pub fn next_trigger(&mut self) -> (u64, u64) {
        let ev = self.event;
        self.event += 1;
        let t = self.t_ns as u64;
        match self.mode {
            TriggerMode::Unlimited => {}
            TriggerMode::Periodic => self.t_ns += self.period_ns,
            TriggerMode::Poisson => {
                let u = unit(splitmix(self.seed ^ splitmix(ev.wrapping_add(0x7157))));
                self.t_ns += -u.ln() * self.period_ns;
            }
        }
        (ev, t)
    }
}

/// Trigger type of an event: 1..=types, the same for every source.
pub fn trigger_type(seed: u64, event: u64, types: u16) -> u16 {
    1 + (splitmix(seed.rotate_left(17) ^ event) % types.max(1) as u64) as u16
}

/// Payload size of (source, event): `mean` when `spread` is 0, else normal(mean, spread) clamped
/// to [0, max].
pub fn payload_size(seed: u64, source: u32, event: u64, mean: u64, spread: u64, max: u64) -> u64 {
    if spread == 0 {
        return mean.min(max);
    }
    let h = splitmix(seed ^ splitmix(event ^ ((source as u64) << 44)));
    let (u1, u2) = (unit(h), unit(splitmix(h)));
    let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
    (mean as f64 + z * spread as f64)
        .round()
        .clamp(0.0, max as f64) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_mean_gap_matches_rate() {
        let mut s = TriggerSchedule::new(TriggerMode::Poisson, 8000.0, 42);
        let mut last = 0;
        for _ in 0..100_000 {
            last = s.next_trigger().1;
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
}

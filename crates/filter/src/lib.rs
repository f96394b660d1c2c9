//! The filter unit's decision (CMS FU, ATLAS HLT): accept or reject each event, looking at the
//! fragments it was given. With a region of interest (RoI), builders fetch only the RoI sources
//! first, ask the filter, and fetch the rest only for accepted events (the ATLAS two-step
//! pattern); rejected events are cleared without the rest ever moving.
//!
//! Decisions must depend on the event alone, never on what the filter saw before: after a
//! builder fails, its events are decided again elsewhere and must come out the same.

use tessera_config::{Decision, FilterSection};

/// One fragment the filter may look at.
pub struct FragmentRef<'a> {
    pub source_id: u32,
    pub payload: &'a [u8],
}

/// A filter decision; plug user code in by implementing it.
pub trait Filter: Send + Sync {
    /// Sources to fetch before deciding; empty: the whole event.
    fn roi(&self) -> &[u32];
    /// Whether to keep the event, from the fragments of the RoI (or all, without one).
    fn accept(&self, event_id: u64, fragments: &[FragmentRef<'_>]) -> bool;
}

/// The built-in decisions of `[filter]`.
pub struct Builtin {
    decision: Decision,
    prescale: u64,
    /// `fraction` scaled to the 64-bit hash range.
    threshold: u64,
    seed: u64,
    cut_source: u32,
    cut_word: usize,
    cut_min: u32,
    cut_max: u32,
    roi: Vec<u32>,
}

impl Builtin {
    /// From a checked `[filter]` section and its resolved RoI.
    pub fn new(f: &FilterSection, roi: Vec<u32>) -> Builtin {
        let threshold = if f.fraction >= 1.0 {
            u64::MAX
        } else {
            (f.fraction * u64::MAX as f64) as u64
        };
        Builtin {
            decision: f.decision,
            prescale: f.prescale.max(1),
            threshold,
            seed: f.seed,
            cut_source: f.cut_source,
            cut_word: f.cut_word as usize,
            cut_min: f.cut_min,
            cut_max: f.cut_max,
            roi,
        }
    }
}

/// splitmix64: a fixed, documented hash, so that every builder (and a re-run) decides alike.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl Filter for Builtin {
    fn roi(&self) -> &[u32] {
        &self.roi
    }

    fn accept(&self, event_id: u64, fragments: &[FragmentRef<'_>]) -> bool {
        match self.decision {
            Decision::AcceptAll => true,
            Decision::Prescale => event_id.is_multiple_of(self.prescale),
            Decision::Random => {
                self.threshold == u64::MAX || mix(event_id ^ mix(self.seed)) < self.threshold
            }
            Decision::Cut => fragments
                .iter()
                .find(|f| f.source_id == self.cut_source)
                .and_then(|f| f.payload.get(4 * self.cut_word..4 * self.cut_word + 4))
                .map(|w| u32::from_le_bytes(w.try_into().expect("4 bytes")))
                .is_some_and(|v| (self.cut_min..=self.cut_max).contains(&v)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(decision: Decision) -> FilterSection {
        FilterSection {
            decision,
            ..Default::default()
        }
    }

    #[test]
    fn prescale_keeps_one_in_n() {
        let f = Builtin::new(
            &FilterSection {
                prescale: 10,
                ..section(Decision::Prescale)
            },
            vec![],
        );
        let kept = (0..1000).filter(|&e| f.accept(e, &[])).count();
        assert_eq!(kept, 100);
    }

    #[test]
    fn random_keeps_about_the_fraction_and_decides_alike_every_time() {
        let f = Builtin::new(
            &FilterSection {
                fraction: 0.25,
                ..section(Decision::Random)
            },
            vec![],
        );
        let kept = (0..100_000).filter(|&e| f.accept(e, &[])).count();
        assert!((23_000..27_000).contains(&kept), "kept {kept}");
        for e in 0..1000 {
            assert_eq!(f.accept(e, &[]), f.accept(e, &[]));
        }
    }

    #[test]
    fn cut_reads_the_payload_word_of_its_source() {
        let f = Builtin::new(
            &FilterSection {
                cut_source: 3,
                cut_word: 1,
                cut_min: 10,
                cut_max: 20,
                ..section(Decision::Cut)
            },
            vec![3],
        );
        let p = |v: u32| {
            [0u8, 0, 0, 0]
                .into_iter()
                .chain(v.to_le_bytes())
                .collect::<Vec<u8>>()
        };
        let (a, b) = (p(15), p(25));
        fn frag(s: u32, x: &[u8]) -> Vec<FragmentRef<'_>> {
            vec![FragmentRef {
                source_id: s,
                payload: x,
            }]
        }
        assert!(f.accept(0, &frag(3, &a)));
        assert!(!f.accept(0, &frag(3, &b)));
        assert!(
            !f.accept(0, &frag(4, &a)),
            "another source's word does not count"
        );
        assert!(
            !f.accept(0, &frag(3, &[1, 2])),
            "a short payload is rejected"
        );
    }
}

//! Model test: any interleaving of offers, closes, timeouts and flushes conserves items. Every
//! offered item comes out exactly once: inside a departed event, or returned as duplicate, late or
//! closed, or still held.

use proptest::prelude::*;
use tessera_assembly::{Assembler, Offer};

#[derive(Clone, Debug)]
enum Op {
    Offer { c: usize, ev: u64 },
    Tick(u64),
    Close(usize),
}

fn op(n: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0..n, 0u64..20).prop_map(|(c, ev)| Op::Offer { c, ev }),
        2 => (1u64..50).prop_map(Op::Tick),
        1 => (0..n).prop_map(Op::Close),
    ]
}

proptest! {
    #[test]
    fn items_are_conserved(n in 1usize..6, ops in proptest::collection::vec(op(5), 0..200)) {
        let mut a = Assembler::new(n, 30, 8);
        let mut now = 0u64;
        let mut offered = 0usize;
        let mut out_in_events = 0usize;
        let mut returned = 0usize;
        for o in ops {
            match o {
                Op::Offer { c, ev } => {
                    let c = c % n;
                    offered += 1;
                    match a.offer(c, ev, (c, ev), now) {
                        Offer::Held => {}
                        Offer::Ready(e) => {
                            for (i, p) in e.parts.iter().enumerate() {
                                if let Some((pc, pev)) = p { prop_assert_eq!((*pc, *pev), (i, ev)); }
                            }
                            out_in_events += e.parts.iter().flatten().count();
                        }
                        Offer::Duplicate(_) | Offer::Late(_) | Offer::Closed(_) => returned += 1,
                    }
                }
                Op::Tick(dt) => {
                    now += dt;
                    for e in a.expire(now) {
                        prop_assert!(!e.missing.is_empty());
                        out_in_events += e.parts.iter().flatten().count();
                    }
                }
                Op::Close(c) => {
                    for e in a.close(c % n) { out_in_events += e.parts.iter().flatten().count(); }
                }
            }
            prop_assert_eq!(offered, out_in_events + returned + a.held_items());
        }
        for e in a.flush() { out_in_events += e.parts.iter().flatten().count(); }
        prop_assert_eq!(a.held_items(), 0);
        prop_assert_eq!(offered, out_in_events + returned);
    }
}

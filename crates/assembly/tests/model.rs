//! Model test: any interleaving of offers, closes, timeouts and flushes conserves items. Every
//! offered item comes out exactly once: inside a departed event, or returned as duplicate, late or
//! closed, or still held.

use proptest::prelude::*;
use tessera_assembly::{Assembler, Offer};

#[derive(Clone, Debug)]
enum Op {
    Offer {
        c: usize,
        ev: u64,
    },
    Tick(u64),
    Close(usize),
    /// The contributor's reader found nothing for this long.
    Quiet(usize, u64),
    Heard(usize),
    Promise(usize, u64),
}

fn op(n: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0..n, 0u64..20).prop_map(|(c, ev)| Op::Offer { c, ev }),
        2 => (1u64..50).prop_map(Op::Tick),
        1 => (0..n).prop_map(Op::Close),
        2 => (0..n, 1u64..50).prop_map(|(c, d)| Op::Quiet(c, d)),
        1 => (0..n).prop_map(Op::Heard),
        1 => (0..n, 0u64..25).prop_map(|(c, f)| Op::Promise(c, f)),
    ]
}

/// Operations that never excuse a contributor: items, time passing, nothing else.
fn held_op(n: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0..n, 0u64..20).prop_map(|(c, ev)| Op::Offer { c, ev }),
        2 => (1u64..5000).prop_map(Op::Tick),
    ]
}

proptest! {
    #[test]
    fn items_are_conserved(
        n in 1usize..6,
        ordered in any::<bool>(),
        max_open in 1usize..8,
        ops in proptest::collection::vec(op(5), 0..200),
    ) {
        let mut a = Assembler::new(n, 30, 8).ordered(ordered).with_max_open(max_open);
        let mut now = 0u64;
        let mut offered = 0usize;
        let mut out_in_events = 0usize;
        let mut returned = 0usize;
        // The events the model knows to be open, to check the assembler's lowest one.
        let mut open = std::collections::BTreeSet::new();
        // What the model knows of each contributor: closed, and its floor (items of an ordered
        // one, promises). An event that leaves without timing out lacks only contributors
        // closed or past it.
        let mut closed = vec![false; n];
        let mut floor = vec![0u64; n];
        for o in ops {
            match o {
                Op::Offer { c, ev } => {
                    let c = c % n;
                    offered += 1;
                    let o = a.offer(c, ev, (c, ev), now);
                    if ordered && !closed[c] && ev >= floor[c] {
                        floor[c] = ev + 1;
                    }
                    let excused = |e: &tessera_assembly::Assembled<(usize, u64)>| {
                        e.missing.iter().all(|&m| closed[m] || floor[m] > e.event_id)
                    };
                    if let Offer::Ready(e) = &o {
                        prop_assert!(excused(e), "{:?}", e.missing);
                    }
                    for e in a.take_passed().collect::<Vec<_>>() {
                        prop_assert!(excused(&e), "{:?}", e.missing);
                        prop_assert!(ordered);
                        prop_assert!(e.event_id < ev);
                        prop_assert!(e.missing.contains(&c));
                        open.remove(&e.event_id);
                        out_in_events += e.parts.iter().flatten().count();
                    }
                    match o {
                        Offer::Held => {
                            open.insert(ev);
                        }
                        Offer::Ready(e) => {
                            open.remove(&e.event_id);
                            for (i, p) in e.parts.iter().enumerate() {
                                if let Some((pc, pev)) = p { prop_assert_eq!((*pc, *pev), (i, ev)); }
                            }
                            out_in_events += e.parts.iter().flatten().count();
                        }
                        Offer::Duplicate(_) | Offer::Late(_) | Offer::Closed(_) | Offer::Full(_) => {
                            returned += 1
                        }
                    }
                    // The cap, and one event per contributor older than every open one.
                    prop_assert!(a.pending_events() <= max_open + n);
                }
                Op::Tick(dt) => {
                    now += dt;
                    for e in a.expire(now) {
                        open.remove(&e.event_id);
                        prop_assert!(!e.missing.is_empty());
                        out_in_events += e.parts.iter().flatten().count();
                    }
                }
                Op::Close(c) => {
                    closed[c % n] = true;
                    for e in a.close(c % n) {
                        prop_assert!(e.missing.iter().all(|&m| closed[m] || floor[m] > e.event_id));
                        open.remove(&e.event_id);
                        out_in_events += e.parts.iter().flatten().count();
                    }
                }
                Op::Quiet(c, d) => {
                    a.quiet(c % n, now, now + d);
                    now += d;
                }
                Op::Heard(c) => a.heard(c % n),
                Op::Promise(c, f) => {
                    let c = c % n;
                    a.promise_floor(c, f);
                    floor[c] = floor[c].max(f);
                    // Events that lacked only contributors past them leave at once.
                    for e in a.take_passed() {
                        prop_assert!(e.missing.iter().all(|&m| closed[m] || floor[m] > e.event_id));
                        prop_assert!(e.event_id < f);
                        prop_assert!(e.missing.contains(&c));
                        open.remove(&e.event_id);
                        out_in_events += e.parts.iter().flatten().count();
                    }
                }
            }
            prop_assert_eq!(offered, out_in_events + returned + a.held_items());
            prop_assert_eq!(a.lowest_open(), open.first().copied());
        }
        for e in a.flush() { out_in_events += e.parts.iter().flatten().count(); }
        prop_assert_eq!(a.held_items(), 0);
        prop_assert_eq!(offered, out_in_events + returned);
    }
}

proptest! {
    /// Back-pressure is not loss: when no contributor is ever silent, closed, past an event or
    /// promised past it (they are only held), no event ever times out, however long it waits,
    /// and no item is ever late.
    #[test]
    fn held_contributors_never_time_out(
        n in 2usize..6,
        ops in proptest::collection::vec(held_op(5), 0..300),
    ) {
        let mut a = Assembler::new(n, 30, 64);
        let mut now = 0u64;
        for o in ops {
            match o {
                Op::Offer { c, ev } => {
                    if let Offer::Ready(e) = a.offer(c % n, ev, (), now) {
                        prop_assert!(e.is_complete());
                    }
                }
                Op::Tick(dt) => {
                    now += dt;
                    prop_assert!(a.expire(now).is_empty());
                }
                _ => unreachable!(),
            }
        }
        prop_assert_eq!(a.stats.late, 0);
        prop_assert_eq!(a.stats.incomplete, 0);
    }
}

proptest! {
    /// Back-pressure is not loss, and the table's cap never stands the assembler still: each
    /// contributor offers its own ascending events (skipping some), an item handed back by the
    /// full table is offered again later, and no timeout or silence ever happens; a contributor
    /// of an unordered assembler promises, after each item, that it is past it (a readout unit
    /// whose every super-fragment is followed by its floor; while the table hands the item back,
    /// the builder applies that promise as far as the item), and one that has offered everything
    /// closes (the end of its stream). No item is ever late or a duplicate, every item goes in,
    /// and the table stays within its cap plus one event per contributor.
    #[test]
    fn a_full_table_holds_links_but_never_stands_them_still(
        n in 2usize..5,
        max_open in 1usize..6,
        streams in proptest::collection::vec(
            proptest::collection::btree_set(0u64..40, 0..30), 5),
        order in proptest::collection::vec(0usize..5, 0..400),
        ordered in any::<bool>(),
    ) {
        let mut a = Assembler::new(n, u64::MAX, 256).ordered(ordered).with_max_open(max_open);
        let mut queues: Vec<std::collections::VecDeque<u64>> =
            streams.into_iter().take(n).map(|s| s.into_iter().collect()).collect();
        let offer = |a: &mut Assembler<()>, c: usize, q: &mut std::collections::VecDeque<u64>|
            -> Result<bool, TestCaseError> {
            let Some(&ev) = q.front() else { return Ok(false) };
            let o = a.offer(c, ev, (), 0);
            // Events an item handed back still let go (its contributor is past them) are
            // progress too.
            let released = a.take_passed().count() > 0;
            match o {
                Offer::Full(()) => {
                    if !ordered {
                        // The promise read behind the held item, as far as the item: everything
                        // below it was sent before (the builder applies it so).
                        a.promise_floor(c, ev);
                        return Ok(a.take_passed().count() > 0 || released);
                    }
                    Ok(released)
                }
                Offer::Held | Offer::Ready(_) => {
                    q.pop_front();
                    if !ordered {
                        a.promise_floor(c, ev + 1);
                        let _ = a.take_passed().count();
                    }
                    Ok(true)
                }
                other => Err(TestCaseError::fail(format!("{other:?} for {c}'s event {ev}"))),
            }
        };
        for c in order {
            let c = c % n;
            offer(&mut a, c, &mut queues[c])?;
            prop_assert!(a.pending_events() <= max_open + n);
        }
        // Then every link offers until all is in: a round in which nobody's item goes in, with
        // items left, is a stand-still.
        loop {
            let mut moved = false;
            for (c, q) in queues.iter_mut().enumerate() {
                if q.is_empty() {
                    if !a.is_closed(c) {
                        a.close(c);
                        moved = true;
                    }
                    continue;
                }
                moved |= offer(&mut a, c, q)?;
                prop_assert!(a.pending_events() <= max_open + n);
            }
            if queues.iter().all(|q| q.is_empty()) {
                break;
            }
            prop_assert!(moved, "stood still: {:?}", queues.iter().map(|q| q.front()).collect::<Vec<_>>());
        }
        prop_assert_eq!(a.stats.late + a.stats.duplicates, 0);
    }
}

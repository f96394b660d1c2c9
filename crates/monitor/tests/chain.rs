//! The chain of stations in one process: order, selection, prescale, blocking against sampling,
//! restore policies, parallel groups, live changes and refused options.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tessera_config::{Distribution, MonitorSection, Restore, StationMode, StationSection};
use tessera_format::event::{EventFlags, EventRecordHeader};
use tessera_monitor::{Monitor, MonitorError, Wait};

/// An event record with `payload` bytes of body (not fragments: the chain never looks inside).
fn record(event_id: u64, trigger_type: u16, payload: usize) -> Vec<u8> {
    let h = EventRecordHeader {
        flags: EventFlags(0),
        event_id,
        timestamp: event_id * 10,
        trigger_type,
        builder_id: 0,
        fragment_count: 0,
        record_size: (48 + payload) as u32,
        missing: vec![],
        checksum: 0,
    };
    let mut v = Vec::new();
    h.encode_into(&mut v);
    v.extend((0..payload).map(|i| (event_id as u8).wrapping_add(i as u8)));
    v
}

fn station(name: &str, mode: StationMode) -> StationSection {
    StationSection {
        name: name.into(),
        mode,
        ..Default::default()
    }
}

fn monitor(stations: Vec<StationSection>) -> Monitor {
    Monitor::new(&MonitorSection {
        stations,
        streams: BTreeMap::from([("calibration".to_string(), vec![2, 3])]),
        ..Default::default()
    })
    .unwrap()
}

fn ids(events: &[tessera_monitor::Event]) -> Vec<u64> {
    events.iter().map(|e| e.header.event_id).collect()
}

#[test]
fn a_blocking_station_gets_every_event_in_order_of_arrival() {
    let m = monitor(vec![StationSection {
        queue: 16,
        ..station("all", StationMode::Blocking)
    }]);
    let c = m.attach("all", "test").unwrap();
    let producer = {
        let m = m.clone();
        std::thread::spawn(move || {
            for id in 1..=5000u64 {
                m.insert(&record(id, 1, 64));
            }
        })
    };
    let mut seen = Vec::new();
    while seen.len() < 5000 {
        let got = c.get(7, Wait::Sleep).unwrap();
        for e in &got {
            assert_eq!(&e.bytes[..], &record(e.header.event_id, 1, 64)[..]);
        }
        seen.extend(ids(&got));
        c.put(got).unwrap();
    }
    producer.join().unwrap();
    assert_eq!(seen, (1..=5000).collect::<Vec<_>>());
    let st = &m.status().stations[0];
    // The queue of 16 held the producer back: it had to wait for the consumer.
    assert!(st.counters.waits > 0, "{st:?}");
    assert_eq!(st.counters.put, 5000);
    assert_eq!(m.status().events_out, 5000);
}

/// Issue 14: a producer waiting at a full blocking station is woken once a quarter of the
/// queue is free, not at every put back (with one event per call, that is one wake-up per
/// batch of inserts rather than per event). Whatever the station is full by, count or bytes,
/// the puts of a consumer taking one event per call reach that point: the producer is never
/// left waiting, and every event arrives in order.
#[test]
fn a_producer_waiting_at_a_full_station_goes_on_when_events_are_put_one_by_one() {
    // (queue in events, queue in bytes, events in the station when it is full)
    for (queue, queue_bytes, full) in [(8usize, 64 << 20, 8usize), (100, 1000, 2)] {
        let events = 400u64;
        let m = monitor(vec![StationSection {
            queue,
            queue_bytes: tessera_config::ByteSize(queue_bytes),
            ..station("all", StationMode::Blocking)
        }]);
        let c = m.attach("all", "one at a time").unwrap();
        let producer = {
            let m = m.clone();
            std::thread::spawn(move || {
                for id in 1..=events {
                    m.insert(&record(id, 1, 400 - 48));
                }
            })
        };
        // The station fills before anything is taken: the producer must wait, then be woken.
        while m.status().stations[0].queue_depth < full {
            std::thread::yield_now();
        }
        let mut seen = Vec::new();
        while seen.len() < events as usize {
            let got = c.get(1, Wait::Sleep).unwrap();
            seen.extend(ids(&got));
            c.put(got).unwrap();
        }
        producer.join().unwrap();
        assert_eq!(seen, (1..=events).collect::<Vec<_>>(), "queue {queue}");
        let st = &m.status().stations[0];
        assert!(st.counters.waits > 0, "{st:?}");
        assert_eq!(st.counters.put, events, "{st:?}");
        assert_eq!((st.queue_depth, st.held), (0, 0), "{st:?}");
    }
}

#[test]
fn a_sampling_consumer_that_never_reads_holds_nothing_up() {
    let m = monitor(vec![
        StationSection {
            queue: 10,
            ..station("display", StationMode::Sampling)
        },
        StationSection {
            queue: 10,
            ..station("histograms", StationMode::Sampling)
        },
    ]);
    let _asleep = m.attach("display", "asleep").unwrap();
    let _asleep_too = m.attach("histograms", "asleep too").unwrap();
    // The inserting thread is this one: if a sampling station could block it, the test would
    // never get past this loop.
    for id in 1..=20_000u64 {
        m.insert(&record(id, 1, 32));
    }
    let s = m.status();
    assert_eq!(s.events_in, 20_000);
    assert_eq!(s.events_out, 20_000);
    for st in &s.stations {
        assert_eq!(st.queue_depth, 10);
        assert_eq!(st.counters.queued, 10);
        assert_eq!(st.counters.dropped_full, 19_990);
        assert_eq!(st.counters.waits, 0);
    }
}

#[test]
fn prescale_takes_exactly_every_nth_selected_event_in_both_modes() {
    for mode in [StationMode::Blocking, StationMode::Sampling] {
        let m = monitor(vec![StationSection {
            trigger_types: vec![1],
            prescale: 3,
            queue: 10_000,
            ..station("p", mode)
        }]);
        let c = m.attach("p", "t").unwrap();
        // Trigger types 1, 2, 1, 2, ...: the selected events are the odd IDs.
        for id in 1..=600u64 {
            m.insert(&record(id, if id % 2 == 1 { 1 } else { 2 }, 8));
        }
        let got = c.get(10_000, Wait::Poll).unwrap();
        let want: Vec<u64> = (1..=600u64)
            .filter(|id| id % 2 == 1)
            .skip(2)
            .step_by(3)
            .collect();
        assert_eq!(ids(&got), want, "{mode:?}");
        let st = &m.status().stations[0];
        assert_eq!(st.counters.selected, 300);
        assert_eq!(st.counters.prescaled_out, 200);
        c.put(got).unwrap();
    }
}

#[test]
fn selection_by_stream_and_by_predicate() {
    let m = monitor(vec![
        StationSection {
            stream: Some("calibration".into()),
            queue: 1000,
            ..station("calib", StationMode::Sampling)
        },
        StationSection {
            predicate: Some("event_id % 10 == 0 && size > 60".into()),
            queue: 1000,
            ..station("tenth", StationMode::Sampling)
        },
    ]);
    let calib = m.attach("calib", "c").unwrap();
    let tenth = m.attach("tenth", "t").unwrap();
    for id in 1..=100u64 {
        // Big records only for IDs above 50.
        m.insert(&record(id, (id % 4) as u16, if id > 50 { 32 } else { 0 }));
    }
    let c = calib.get(1000, Wait::Poll).unwrap();
    assert!(c.iter().all(|e| matches!(e.header.trigger_type, 2 | 3)));
    assert_eq!(c.len(), 50);
    assert_eq!(
        ids(&tenth.get(1000, Wait::Poll).unwrap()),
        vec![60, 70, 80, 90, 100]
    );
}

#[test]
fn timed_and_polled_gets_return_empty_without_events() {
    let m = monitor(vec![station("s", StationMode::Sampling)]);
    let c = m.attach("s", "t").unwrap();
    assert!(c.get(10, Wait::Poll).unwrap().is_empty());
    assert!(c.get(10, Wait::Timed(20)).unwrap().is_empty());
    m.insert(&record(1, 1, 0));
    assert_eq!(ids(&c.get(10, Wait::Timed(1000)).unwrap()), vec![1]);
}

#[test]
fn a_dead_consumers_events_go_back_to_the_station_for_another_consumer() {
    let m = monitor(vec![StationSection {
        restore: Some(Restore::Station),
        queue: 100,
        ..station("b", StationMode::Blocking)
    }]);
    let a = m.attach("b", "a").unwrap();
    let b = m.attach("b", "b").unwrap();
    for id in 1..=10u64 {
        m.insert(&record(id, 1, 0));
    }
    let held = a.get(4, Wait::Poll).unwrap();
    assert_eq!(ids(&held), vec![1, 2, 3, 4]);
    drop(a); // dies holding 1..4
    let got = b.get(100, Wait::Poll).unwrap();
    assert_eq!(ids(&got), (1..=10).collect::<Vec<_>>());
    assert_eq!(m.status().stations[0].counters.restored, 4);
    b.put(got).unwrap();
    assert_eq!(m.status().events_out, 10);
}

#[test]
fn a_dead_consumers_events_pass_on_to_the_next_station() {
    let m = monitor(vec![
        StationSection {
            restore: Some(Restore::Next),
            ..station("first", StationMode::Blocking)
        },
        station("second", StationMode::Blocking),
    ]);
    let a = m.attach("first", "a").unwrap();
    let other = m.attach("first", "other").unwrap();
    let second = m.attach("second", "s").unwrap();
    for id in 1..=6u64 {
        m.insert(&record(id, 1, 0));
    }
    let held = a.get(3, Wait::Poll).unwrap();
    assert_eq!(ids(&held), vec![1, 2, 3]);
    drop(a);
    // Not back to `other` (policy next): straight to the second station.
    assert_eq!(ids(&second.get(100, Wait::Poll).unwrap()), vec![1, 2, 3]);
    assert_eq!(ids(&other.get(100, Wait::Poll).unwrap()), vec![4, 5, 6]);
}

#[test]
fn a_blocking_station_left_without_consumers_passes_its_events_on() {
    let m = monitor(vec![
        station("first", StationMode::Blocking),
        station("second", StationMode::Blocking),
    ]);
    let only = m.attach("first", "only").unwrap();
    let second = m.attach("second", "s").unwrap();
    for id in 1..=5u64 {
        m.insert(&record(id, 1, 0));
    }
    let _held = only.get(2, Wait::Poll).unwrap();
    drop(only); // restore = station, but nobody is left there
    assert_eq!(
        ids(&second.get(100, Wait::Poll).unwrap()),
        vec![1, 2, 3, 4, 5]
    );
}

#[test]
fn a_sampling_consumers_death_releases_and_never_holds_anything() {
    let m = monitor(vec![
        station("sample", StationMode::Sampling),
        station("after", StationMode::Blocking),
    ]);
    let s = m.attach("sample", "s").unwrap();
    let after = m.attach("after", "a").unwrap();
    for id in 1..=5u64 {
        m.insert(&record(id, 1, 0));
    }
    // The sampled events went on at once: the next station has them all, taken or not.
    assert_eq!(
        ids(&after.get(100, Wait::Poll).unwrap()),
        vec![1, 2, 3, 4, 5]
    );
    let _copies = s.get(2, Wait::Poll).unwrap();
    drop(s);
    let st = &m.status().stations[0];
    assert_eq!(st.counters.released, 3);
    assert_eq!(st.queue_depth, 0);
}

#[test]
fn put_moves_events_down_the_chain_with_a_replaced_record() {
    let m = monitor(vec![
        station("process", StationMode::Blocking),
        station("record", StationMode::Blocking),
    ]);
    let p = m.attach("process", "p").unwrap();
    let r = m.attach("record", "r").unwrap();
    m.insert(&record(1, 1, 10));
    m.insert(&record(2, 1, 10));
    assert!(r.get(10, Wait::Poll).unwrap().is_empty());
    let got = p.get(10, Wait::Poll).unwrap();
    p.put_replaced(got[0].seq, record(1, 7, 99).into()).unwrap();
    p.put(vec![got[1].clone()]).unwrap();
    let out = r.get(10, Wait::Poll).unwrap();
    assert_eq!(ids(&out), vec![1, 2]);
    assert_eq!(out[0].header.trigger_type, 7);
    assert_eq!(out[0].bytes.len(), 48 + 99);
    // Putting twice, or putting what was never taken, is refused.
    assert_eq!(
        p.put(vec![got[1].clone()]),
        Err(MonitorError::NotHeld(got[1].seq))
    );
    let bad = p.put_replaced(12345, record(1, 1, 0).into());
    assert_eq!(bad, Err(MonitorError::NotHeld(12345)));
}

#[test]
fn a_parallel_group_shares_events_round_robin() {
    let group = |name: &str| StationSection {
        group: Some("workers".into()),
        distribution: Some(Distribution::RoundRobin),
        queue: 100,
        ..station(name, StationMode::Blocking)
    };
    let m = monitor(vec![group("w1"), group("w2")]);
    let w1 = m.attach("w1", "1").unwrap();
    let w2 = m.attach("w2", "2").unwrap();
    for id in 1..=10u64 {
        m.insert(&record(id, 1, 0));
    }
    assert_eq!(ids(&w1.get(100, Wait::Poll).unwrap()), vec![1, 3, 5, 7, 9]);
    assert_eq!(ids(&w2.get(100, Wait::Poll).unwrap()), vec![2, 4, 6, 8, 10]);
}

#[test]
fn station_settings_change_while_running() {
    let m = monitor(vec![StationSection {
        queue: 1000,
        ..station("s", StationMode::Sampling)
    }]);
    let c = m.attach("s", "c").unwrap();
    for id in 1..=10u64 {
        m.insert(&record(id, 1, 0));
    }
    m.set_station(StationSection {
        prescale: 5,
        queue: 1000,
        ..station("s", StationMode::Sampling)
    })
    .unwrap();
    for id in 11..=30u64 {
        m.insert(&record(id, 1, 0));
    }
    // 10 selected before (prescale 1), then the counter goes on: 15, 20, 25, 30 are multiples
    // of 5 among selected events 11..30.
    assert_eq!(
        ids(&c.get(1000, Wait::Poll).unwrap()),
        vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 20, 25, 30]
    );
    // A larger queue lets a waiting producer in at once.
    let b = monitor(vec![StationSection {
        queue: 1,
        ..station("b", StationMode::Blocking)
    }]);
    let bc = b.attach("b", "c").unwrap();
    b.insert(&record(1, 1, 0));
    let producer = {
        let b = b.clone();
        std::thread::spawn(move || b.insert(&record(2, 1, 0)))
    };
    while b.status().stations[0].counters.waits == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    b.set_station(StationSection {
        queue: 2,
        ..station("b", StationMode::Blocking)
    })
    .unwrap();
    producer.join().unwrap();
    assert_eq!(ids(&bc.get(10, Wait::Poll).unwrap()), vec![1, 2]);
}

#[test]
fn options_that_cannot_apply_are_refused() {
    let refused = |stations: Vec<StationSection>| {
        Monitor::new(&MonitorSection {
            stations,
            ..Default::default()
        })
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
    };
    let e = refused(vec![StationSection {
        restore: Some(Restore::Next),
        ..station("s", StationMode::Sampling)
    }]);
    assert!(e.contains("restore") && e.contains("sampling"), "{e}");
    let e = refused(vec![StationSection {
        restore: Some(Restore::Release),
        ..station("b", StationMode::Blocking)
    }]);
    assert!(e.contains("never loses events"), "{e}");
    let e = refused(vec![StationSection {
        distribution: Some(Distribution::EqualQueue),
        ..station("s", StationMode::Sampling)
    }]);
    assert!(e.contains("group"), "{e}");
    let e = refused(vec![StationSection {
        prescale: 0,
        ..station("s", StationMode::Sampling)
    }]);
    assert!(e.contains("prescale"), "{e}");
    let e = refused(vec![StationSection {
        stream: Some("nope".into()),
        ..station("s", StationMode::Sampling)
    }]);
    assert!(e.contains("not declared"), "{e}");
    let e = refused(vec![
        station("twice", StationMode::Sampling),
        station("twice", StationMode::Sampling),
    ]);
    assert!(e.contains("used twice"), "{e}");

    let m = monitor(vec![station("s", StationMode::Sampling)]);
    let e = m
        .set_station(station("s", StationMode::Blocking))
        .unwrap_err()
        .to_string();
    assert!(e.contains("mode"), "{e}");
    assert!(matches!(
        m.attach("nope", "x"),
        Err(MonitorError::UnknownStation(_))
    ));
    assert!(m
        .create_station(StationSection {
            predicate: Some("colour == 3".into()),
            ..station("new", StationMode::Sampling)
        })
        .is_err());
}

#[test]
fn bad_records_are_counted_not_passed() {
    let m = monitor(vec![station("s", StationMode::Sampling)]);
    let c = m.attach("s", "c").unwrap();
    m.insert(b"not an event record at all, not even close to one");
    let mut cut = record(1, 1, 10);
    cut.pop();
    m.insert(&cut);
    assert_eq!(m.status().bad_records, 2);
    assert!(c.get(10, Wait::Poll).unwrap().is_empty());
}

#[test]
fn closing_releases_a_producer_waiting_for_a_blocking_station() {
    let m = monitor(vec![StationSection {
        queue: 1,
        ..station("b", StationMode::Blocking)
    }]);
    let _c = m.attach("b", "c").unwrap();
    m.insert(&record(1, 1, 0));
    let waiting = Arc::new(m.clone());
    let producer = {
        let m = waiting.clone();
        std::thread::spawn(move || m.insert(&record(2, 1, 0)))
    };
    while m.status().stations[0].counters.waits == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    m.close();
    producer.join().unwrap();
}

/// Issue 11, probe 13: a put naming the same event twice panicked a connection thread and left
/// the event held for good. Now it is refused whole, and the events can still be put back.
#[test]
fn a_put_naming_an_event_twice_is_refused_whole() {
    let m = monitor(vec![StationSection {
        queue: 4,
        ..station("b", StationMode::Blocking)
    }]);
    let c = m.attach("b", "twice").unwrap();
    m.insert(&record(1, 1, 16));
    m.insert(&record(2, 1, 16));
    let got = c.get(2, Wait::Sleep).unwrap();
    assert_eq!(got.len(), 2);
    let seq = got[0].seq;
    let err = c.put(vec![got[0].clone(), got[0].clone()]).unwrap_err();
    assert!(
        matches!(err, MonitorError::Repeated(s) if s == seq),
        "{err:?}"
    );
    assert_eq!(m.status().stations[0].held, 2, "nothing moved");
    c.put(got).unwrap();
    assert_eq!(m.status().stations[0].held, 0);
}

/// Issue 11, item 15: a station's queue is bounded in bytes as well as in events, and the
/// number of stations is capped, so no consumer can make the monitor's memory grow without
/// bound.
#[test]
fn stations_are_bounded_in_bytes_and_in_number() {
    let m = Monitor::new(&MonitorSection {
        stations: vec![StationSection {
            queue: 100,
            queue_bytes: tessera_config::ByteSize(1000),
            ..station("s", StationMode::Sampling)
        }],
        max_stations: 2,
        ..Default::default()
    })
    .unwrap();
    let _c = m.attach("s", "asleep").unwrap();
    for id in 1..=5 {
        m.insert(&record(id, 1, 400 - 48));
    }
    let st = &m.status().stations[0];
    assert_eq!(st.queue_depth, 2, "{st:?}");
    assert_eq!(st.counters.dropped_full, 3, "{st:?}");
    m.create_station(station("second", StationMode::Sampling))
        .unwrap();
    let err = m
        .create_station(station("third", StationMode::Sampling))
        .unwrap_err();
    assert!(
        matches!(&err, MonitorError::Refused { key, .. } if key == "monitor.max_stations"),
        "{err:?}"
    );
}

/// Issue 50, item 7: a blocking station whose consumer holds its events (alive, never putting
/// them back) holds the data path for its `hold_limit_ms` at most: then the consumer is dropped,
/// its events pass on to the next station, the event that waited goes on without this station,
/// and the run goes on, counted.
#[test]
fn a_consumer_that_holds_a_blocking_station_past_its_limit_is_dropped_and_the_run_goes_on() {
    let m = monitor(vec![
        StationSection {
            queue: 3,
            hold_limit_ms: 200,
            ..station("held", StationMode::Blocking)
        },
        station("after", StationMode::Blocking),
    ]);
    let holder = m.attach("held", "holder").unwrap();
    let after = m.attach("after", "after").unwrap();
    for id in 1..=3u64 {
        m.insert(&record(id, 1, 0));
    }
    assert_eq!(ids(&holder.get(3, Wait::Poll).unwrap()), vec![1, 2, 3]);
    // Full, and its consumer never puts back: this insert waits out the limit and returns.
    m.insert(&record(4, 1, 0));
    let s = &m.status().stations[0];
    assert_eq!(s.counters.hold_limit_drops, 1, "{:?}", s.counters);
    assert!(s.consumers.is_empty(), "the holder was dropped: {s:?}");
    // Its events went on to the next station, the one that waited too; later ones pass freely.
    m.insert(&record(5, 1, 0));
    let mut got = ids(&after.get(100, Wait::Poll).unwrap());
    got.sort_unstable();
    assert_eq!(got, vec![1, 2, 3, 4, 5]);
    // The dropped consumer is told when it next asks.
    assert!(holder.get(1, Wait::Poll).is_err());
}

//! A builder link that breaks and is opened again (wire format §2.8), over real sockets and
//! files: records the recorder holds already and that come again after a resend message are
//! dropped and counted as resent, never as second copies, and the new link's acknowledgements
//! count from its own hello. A recorder started with the files of an earlier one of its run
//! (adopted) drops what they hold the same way.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::time::Duration;

use tessera_format::event::{EventFlags, EventRecordHeader};
use tessera_format::link::{decode_link, LinkItem, PeerEnd, PeerHello, PeerRole, Resend};
use tessera_format::wire::{encode_fragment, FragmentHeader};
use tessera_recorder::{Adopted, Recorder, RecorderConfig};

fn record(event_id: u64) -> Vec<u8> {
    let mut f = Vec::new();
    let h = FragmentHeader {
        status: 0,
        source_id: 1,
        trigger_type: 1,
        event_id,
        timestamp: event_id,
        payload_size: 8,
    };
    encode_fragment(&mut f, &h, &event_id.to_le_bytes());
    let mut eh = EventRecordHeader {
        flags: EventFlags(0),
        event_id,
        timestamp: event_id,
        trigger_type: 1,
        builder_id: 0,
        fragment_count: 1,
        record_size: 0,
        missing: Vec::new(),
        checksum: 0,
    };
    eh.record_size = (eh.header_size() + f.len()) as u32;
    let mut r = Vec::new();
    eh.encode_into(&mut r);
    let crc = EventRecordHeader::checksum_over(&r, [&f[..]]);
    EventRecordHeader::seal(&mut r, crc);
    r.extend_from_slice(&f);
    r
}

fn start(dir: &std::path::Path, adopted: Adopted) -> (Recorder, String) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let settings = tessera_config::RecorderSection {
        fsync: false,
        disk_soft_free: tessera_config::ByteSize(0),
        disk_hard_free: tessera_config::ByteSize(0),
        disk_reserve: tessera_config::ByteSize(0),
        ..Default::default()
    };
    let rec = Recorder::start(RecorderConfig {
        listener,
        builders: vec![0],
        output: dir.to_path_buf(),
        run_number: 5,
        config_digest: [0; 32],
        pattern: String::new(),
        sources: vec![1],
        pattern_sources: Vec::new(),
        settings,
        max_message: 1 << 20,
        monitor: None,
        takeover: Duration::from_secs(60),
        adopted,
        histograms: Default::default(),
    })
    .unwrap();
    (rec, addr)
}

/// A builder's link: its hello (asking for acknowledgements) written.
fn link(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let hello = PeerHello {
        role: PeerRole::BuilderUnit,
        id: 0,
        flags: PeerHello::WANTS_ACKS,
    };
    s.write_all(&hello.encode()).unwrap();
    s
}

/// Reads acknowledgements until one covers `records` (or the link closes); the last count.
fn acked(s: &mut TcpStream, records: u64) -> u64 {
    acked_from(s, records, 0)
}

/// [`acked`] on a link already acknowledged up to `from`.
fn acked_from(s: &mut TcpStream, records: u64, from: u64) -> u64 {
    let (mut buf, mut last) = (Vec::new(), from);
    let mut tmp = [0u8; 256];
    while last < records {
        while let Ok((LinkItem::Ack(a), n)) = decode_link(&buf, 0) {
            buf.drain(..n);
            last = a.records;
        }
        if last >= records {
            break;
        }
        match s.read(&mut tmp) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
        }
    }
    last
}

/// Opens the link again, as a builder does after a break: the resend message, the records
/// (`resent` of them sent again), until the recorder takes the link (it refuses a hello while
/// it has not yet seen the old link break, and the builder tries again). The link, once the
/// recorder acknowledged every record on it.
fn relink(addr: &str, resent: u64, ids: &[u64]) -> TcpStream {
    for _ in 0..1000 {
        let mut s = link(addr);
        s.write_all(&Resend { records: resent }.encode()).unwrap();
        for &id in ids {
            if s.write_all(&record(id)).is_err() {
                break;
            }
        }
        if acked(&mut s, ids.len() as u64) == ids.len() as u64 {
            return s;
        }
    }
    panic!("the recorder never took the link again");
}

fn end(s: &mut TcpStream, units: u64) {
    let e = PeerEnd {
        role: PeerRole::BuilderUnit,
        id: 0,
        units,
        fragments: units,
    };
    s.write_all(&e.encode()).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
}

fn ids_in(dir: &std::path::Path) -> Vec<u64> {
    let mut v = Vec::new();
    for f in std::fs::read_dir(dir).unwrap().flatten() {
        if !f.file_name().to_string_lossy().ends_with(".tsr") {
            continue;
        }
        let mut r = tessera_archive::FileReader::open(&f.path()).unwrap();
        while let Some((_, raw)) = r.next_block().unwrap() {
            v.extend(tessera_archive::events_in(raw).map(|e| e.unwrap().header.event_id));
        }
    }
    v.sort_unstable();
    v
}

#[test]
fn a_resent_record_the_file_holds_is_dropped_as_resent_and_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let (rec, addr) = start(dir.path(), Adopted::default());
    let mut s = link(&addr);
    for id in 0..3 {
        s.write_all(&record(id)).unwrap();
    }
    assert_eq!(acked(&mut s, 3), 3);
    // The link breaks with no peer end (the builder did not see the acknowledgement of the
    // last two, say).
    drop(s);
    // The new link counts its own records: the two sent again and the new one.
    let mut s = relink(&addr, 2, &[1, 2, 3]);
    end(&mut s, 3);
    // Nothing more to acknowledge: the recorder closes the link.
    assert_eq!(acked_from(&mut s, u64::MAX, 3), 3);
    rec.stop();
    let st = rec.stats.clone();
    rec.join();
    assert_eq!(st.resent_events.load(Ordering::Relaxed), 2);
    assert_eq!(st.duplicate_events.load(Ordering::Relaxed), 0);
    assert_eq!(st.events.load(Ordering::Relaxed), 4);
    assert_eq!(st.relinks.load(Ordering::Relaxed), 1);
    assert_eq!(ids_in(dir.path()), vec![0, 1, 2, 3]);
}

#[test]
fn a_record_sent_twice_without_a_resend_is_a_second_copy() {
    let dir = tempfile::tempdir().unwrap();
    let (rec, addr) = start(dir.path(), Adopted::default());
    let mut s = link(&addr);
    for id in [0, 1, 1] {
        s.write_all(&record(id)).unwrap();
    }
    end(&mut s, 3);
    assert_eq!(acked(&mut s, u64::MAX), 3);
    rec.stop();
    let st = rec.stats.clone();
    rec.join();
    assert_eq!(st.duplicate_events.load(Ordering::Relaxed), 1);
    assert_eq!(st.resent_events.load(Ordering::Relaxed), 0);
    assert_eq!(ids_in(dir.path()), vec![0, 1]);
}

#[test]
fn a_recorder_taking_over_files_drops_what_they_hold_and_writes_after_them() {
    let dir = tempfile::tempdir().unwrap();
    // An earlier recorder of the run wrote events 0..4 in file 1.
    let (rec, addr) = start(dir.path(), Adopted::default());
    let mut s = link(&addr);
    for id in 0..4 {
        s.write_all(&record(id)).unwrap();
    }
    end(&mut s, 4);
    assert_eq!(acked(&mut s, u64::MAX), 4);
    rec.stop();
    let st = rec.stats.clone();
    rec.join();
    let files = st.files.lock().clone();
    assert_eq!(files.len(), 1);
    let adopted = Adopted {
        files: files.clone(),
        event_ids: vec![0, 1, 2, 3],
        events: 4,
        fragments_in_complete: 4,
        ..Default::default()
    };
    let (rec, addr) = start(dir.path(), adopted);
    let mut s = relink(&addr, 2, &[2, 3, 4]);
    end(&mut s, 3);
    assert_eq!(acked_from(&mut s, u64::MAX, 3), 3);
    rec.stop();
    let st = rec.stats.clone();
    rec.join();
    assert_eq!(st.resent_events.load(Ordering::Relaxed), 2);
    assert_eq!(st.events.load(Ordering::Relaxed), 5);
    assert_eq!(st.adopted_events.load(Ordering::Relaxed), 4);
    // The first file kept, the second after it: nothing overwritten, every event once.
    let names: Vec<String> = st.files.lock().iter().map(|f| f.file.clone()).collect();
    assert_eq!(names, vec!["run000005_0001.tsr", "run000005_0002.tsr"]);
    assert_eq!(ids_in(dir.path()), vec![0, 1, 2, 3, 4]);
}

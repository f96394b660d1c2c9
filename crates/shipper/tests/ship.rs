//! The shipper over real directories and the real run database: every finished file reaches
//! every destination verified; a local file goes only when that is so and the policy allows; a
//! corrupted copy is caught and sent again; a copy cut by a crash is made again, once.

use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tessera_shipper::{Destination, DirDestination, Policy, Shipper};

/// A finished file as the recorder leaves it: the file and its sidecar.
fn finished(dir: &Path, name: &str, size: usize) -> Vec<u8> {
    let bytes: Vec<u8> = (0..size).map(|i| (i * 31 + name.len()) as u8).collect();
    std::fs::write(dir.join(name), &bytes).unwrap();
    std::fs::write(dir.join(format!("{name}.json")), b"{}").unwrap();
    bytes
}

fn policy() -> Policy {
    Policy {
        retry_min: Duration::ZERO,
        ..Policy::default()
    }
}

fn states(s: &Shipper) -> Vec<(String, String, String)> {
    s.shipments()
        .unwrap()
        .into_iter()
        .map(|r| (r.file, r.destination, r.state))
        .collect()
}

#[test]
fn every_file_reaches_every_destination_verified_before_it_is_deleted() {
    let t = tempfile::tempdir().unwrap();
    let (data, a, b) = (
        t.path().join("data"),
        t.path().join("a"),
        t.path().join("b"),
    );
    std::fs::create_dir_all(&data).unwrap();
    let one = finished(&data, "run000001_0001.tsr", 3 << 20);
    let two = finished(&data, "run000001_0002.tsr", 1000);
    // Never a file still being written.
    std::fs::write(data.join("run000001_0003.tsr.part"), b"partial").unwrap();
    let dests: Vec<Box<dyn Destination>> = vec![
        Box::new(DirDestination::new(&a)),
        Box::new(DirDestination::new(&b)),
    ];
    let mut s = Shipper::new(&data, dests, policy()).unwrap();
    let p = s.pass().unwrap();
    assert_eq!(
        (p.copied, p.verified, p.failed, p.deleted),
        (4, 4, 0, 2),
        "{p:?}"
    );
    for d in [&a, &b] {
        assert_eq!(std::fs::read(d.join("run000001_0001.tsr")).unwrap(), one);
        assert_eq!(std::fs::read(d.join("run000001_0002.tsr")).unwrap(), two);
        assert!(!d.join("run000001_0003.tsr.part").exists());
        assert!(!d.join("run000001_0003.tsr").exists());
    }
    assert!(!data.join("run000001_0001.tsr").exists());
    assert!(data.join("run000001_0003.tsr.part").exists());
    assert_eq!(p.backlog.files, 0);
    assert!(states(&s).iter().all(|x| x.2 == "verified"));
    // A second pass has nothing to do.
    let p = s.pass().unwrap();
    assert_eq!((p.copied, p.deleted), (0, 0));
}

#[test]
fn a_file_one_destination_lacks_is_never_deleted_and_is_retried() {
    let t = tempfile::tempdir().unwrap();
    let (data, a, b) = (
        t.path().join("data"),
        t.path().join("a"),
        t.path().join("b"),
    );
    std::fs::create_dir_all(&data).unwrap();
    let bytes = finished(&data, "run000002_0001.tsr", 5000);
    // `b` cannot be a directory: a file stands in its place (an unmounted archive, say).
    std::fs::write(&b, b"not a directory").unwrap();
    let dests: Vec<Box<dyn Destination>> = vec![
        Box::new(DirDestination::new(&a)),
        Box::new(DirDestination::new(&b)),
    ];
    let mut s = Shipper::new(&data, dests, policy()).unwrap();
    let p = s.pass().unwrap();
    assert_eq!((p.verified, p.failed, p.deleted), (1, 1, 0), "{p:?}");
    assert!(
        data.join("run000002_0001.tsr").exists(),
        "deleted unverified"
    );
    assert_eq!(p.backlog.files, 1);
    assert_eq!(p.backlog.bytes, 5000);
    let failed = s
        .shipments()
        .unwrap()
        .into_iter()
        .find(|r| r.state == "failed")
        .unwrap();
    assert!(failed.error.is_some(), "{failed:?}");
    // The archive comes back: the next pass ships it, and only then is the local file deleted.
    std::fs::remove_file(&b).unwrap();
    let p = s.pass().unwrap();
    assert_eq!((p.verified, p.failed, p.deleted), (1, 0, 1), "{p:?}");
    assert_eq!(std::fs::read(b.join("run000002_0001.tsr")).unwrap(), bytes);
    let attempts: Vec<u32> = s.shipments().unwrap().iter().map(|r| r.attempts).collect();
    assert_eq!(attempts, vec![1, 2]);
}

/// A destination whose first copy arrives damaged (a bit flipped on the way), as a faulty
/// link or disk would: the read-back catches it and the next pass sends it again.
struct Flaky {
    inner: DirDestination,
    damaged: AtomicBool,
}

impl Destination for Flaky {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn put(&self, file: &str, size: u64, read: &mut dyn Read) -> std::io::Result<()> {
        if self.damaged.swap(true, Ordering::AcqRel) {
            return self.inner.put(file, size, read);
        }
        let mut all = Vec::new();
        read.read_to_end(&mut all)?;
        all[1234] ^= 0x10;
        self.inner.put(file, size, &mut all.as_slice())
    }
    fn check(&self, file: &str) -> std::io::Result<Option<tessera_shipper::Digest>> {
        self.inner.check(file)
    }
}

#[test]
fn a_corrupted_copy_is_caught_and_sent_again() {
    let t = tempfile::tempdir().unwrap();
    let (data, a) = (t.path().join("data"), t.path().join("a"));
    std::fs::create_dir_all(&data).unwrap();
    let bytes = finished(&data, "run000003_0001.tsr", 1 << 20);
    let flaky = Flaky {
        inner: DirDestination::new(&a),
        damaged: AtomicBool::new(false),
    };
    let mut s = Shipper::new(&data, vec![Box::new(flaky)], policy()).unwrap();
    let p = s.pass().unwrap();
    assert_eq!(
        (p.copied, p.verified, p.failed, p.deleted),
        (1, 0, 1, 0),
        "{p:?}"
    );
    let row = &s.shipments().unwrap()[0];
    assert!(row.error.as_deref().unwrap().contains("CRC-32C"), "{row:?}");
    assert!(data.join("run000003_0001.tsr").exists());
    let p = s.pass().unwrap();
    assert_eq!((p.verified, p.deleted), (1, 1), "{p:?}");
    assert_eq!(std::fs::read(a.join("run000003_0001.tsr")).unwrap(), bytes);
}

#[test]
fn a_copy_cut_by_a_crash_is_made_again_and_lands_once() {
    let t = tempfile::tempdir().unwrap();
    let (data, a) = (t.path().join("data"), t.path().join("a"));
    std::fs::create_dir_all(&data).unwrap();
    let bytes = finished(&data, "run000004_0001.tsr", 200_000);
    // What a shipper killed mid-copy leaves: its row says copying, the destination a .part.
    {
        let s = Shipper::new(&data, vec![], policy()).unwrap();
        drop(s);
        let db = tessera_rundb::RunDb::open(&data.join("runs.sqlite")).unwrap();
        db.set_shipment(&tessera_rundb::ShipmentRow {
            file: "run000004_0001.tsr".into(),
            destination: a.display().to_string(),
            size_bytes: 200_000,
            crc32c: String::new(),
            state: "copying".into(),
            attempts: 1,
            error: None,
            next_try_unix_ns: 0,
            updated_unix_ns: 1,
        })
        .unwrap();
        std::fs::create_dir_all(&a).unwrap();
        std::fs::write(a.join("run000004_0001.tsr.part"), &bytes[..50_000]).unwrap();
    }
    let mut s = Shipper::new(&data, vec![Box::new(DirDestination::new(&a))], policy()).unwrap();
    let p = s.pass().unwrap();
    assert_eq!((p.verified, p.deleted), (1, 1), "{p:?}");
    let mut names: Vec<String> = std::fs::read_dir(&a)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["run000004_0001.tsr", "run000004_0001.tsr.json"]);
    assert_eq!(std::fs::read(a.join("run000004_0001.tsr")).unwrap(), bytes);
    assert_eq!(s.shipments().unwrap()[0].attempts, 2);
}

#[test]
fn retention_keeps_shipped_files_until_the_disk_runs_short() {
    let t = tempfile::tempdir().unwrap();
    let (data, a) = (t.path().join("data"), t.path().join("a"));
    std::fs::create_dir_all(&data).unwrap();
    finished(&data, "run000005_0001.tsr", 4096);
    let keep = Policy {
        keep: Duration::from_secs(3600),
        ..policy()
    };
    let mut s = Shipper::new(&data, vec![Box::new(DirDestination::new(&a))], keep.clone()).unwrap();
    let p = s.pass().unwrap();
    assert_eq!((p.verified, p.deleted), (1, 0), "kept for an hour: {p:?}");
    assert!(data.join("run000005_0001.tsr").exists());
    // The disk is short (a watermark above any free space): verified files go at once.
    let short = Policy {
        free_watermark: u64::MAX,
        ..keep
    };
    let mut s = Shipper::new(&data, vec![Box::new(DirDestination::new(&a))], short).unwrap();
    let p = s.pass().unwrap();
    assert_eq!((p.copied, p.deleted), (0, 1), "{p:?}");
    let db = tessera_rundb::RunDb::open(&data.join("runs.sqlite")).unwrap();
    assert_eq!(db.deleted_files().unwrap()[0].2, "free space");
}

use std::collections::BTreeMap;
use tessera_rundb::{ActionRow, FileRow, RunDb, RunEnd, RunStart};

fn start(db: &RunDb, at_least: u64, comment: &str) -> u64 {
    db.begin_run(
        at_least,
        &RunStart {
            config_origin: "t.toml",
            config_sha256: "ab",
            config: "[run]\nevents = 5\n",
            started_unix_ns: 1,
            comment,
        },
    )
    .unwrap()
}

#[test]
fn numbers_are_unique_across_handles_and_records_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("runs.sqlite");
    let a = RunDb::open(&p).unwrap();
    let b = RunDb::open(&p).unwrap();
    let n1 = start(&a, 1, "first");
    let n2 = start(&b, 1, "");
    let n3 = start(&a, 40, "");
    assert_eq!((n1, n2, n3), (1, 2, 40));
    let mut rejected = BTreeMap::new();
    rejected.insert("crc".to_string(), 3u64);
    let files = vec![FileRow {
        name: "run000001_0000.tsr".into(),
        size_bytes: 100,
        events: 5,
        crc32c: "deadbeef".into(),
    }];
    b.end_run(
        n1,
        &RunEnd {
            state: "stopped",
            stopped_unix_ns: 2,
            stop_reason: "events",
            error: None,
            events: 5,
            incomplete: 1,
            bytes: 1000,
            recorded_events: 5,
            balance_holds: Some(true),
            rejected: &rejected,
            files: &files,
            report_json: "{\"run_number\": 1}",
        },
    )
    .unwrap();
    a.log_action(&ActionRow {
        unix_ns: 3,
        who: "127.0.0.1:5 (loopback)".into(),
        action: "stop".into(),
        from_state: "running".into(),
        to_state: "stopped".into(),
        result: "ok".into(),
        run: Some(n1),
    })
    .unwrap();
    a.set_comment(n2, "beam off").unwrap();
    let list = a.list(10).unwrap();
    assert_eq!(
        list.iter().map(|r| r.number).collect::<Vec<_>>(),
        vec![40, 2, 1]
    );
    assert_eq!(list[1].comment, "beam off");
    assert_eq!(list[2].state, "stopped");
    let r = a.get(n1).unwrap();
    assert_eq!(r.summary.comment, "first");
    assert_eq!(r.summary.events, 5);
    assert_eq!(r.summary.balance_holds, Some(true));
    assert_eq!(r.rejected, rejected);
    assert_eq!(r.files, files);
    assert_eq!(r.actions.len(), 1);
    assert_eq!(r.config, "[run]\nevents = 5\n");
    assert_eq!(r.report.unwrap()["run_number"], 1);
    assert!(matches!(a.get(99), Err(tessera_rundb::DbError::NoRun(99))));
    assert!(a.set_comment(99, "x").is_err());
}

#[test]
fn a_newer_schema_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("runs.sqlite");
    drop(RunDb::open(&p).unwrap());
    // A later tessera raised the schema version.
    rusqlite::Connection::open(&p)
        .unwrap()
        .execute_batch("PRAGMA user_version = 7")
        .unwrap();
    let e = RunDb::open(&p)
        .err()
        .expect("a newer schema must be refused");
    assert!(e.to_string().contains("schema version 7"), "{e}");
}

use std::collections::BTreeMap;
use tessera_rundb::{
    ActionRow, AlarmActionRow, FileRow, HistoryPoint, NoteRow, RunDb, RunEnd, RunStart,
};

fn start(db: &RunDb, at_least: u64, comment: &str) -> u64 {
    db.begin_run(
        at_least,
        &RunStart {
            config_origin: "t.toml",
            config_sha256: "ab",
            config: "[run]\nevents = 5\n",
            started_unix_ns: 1,
            comment,
            who: "alice",
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

#[test]
fn a_run_keeps_its_start_and_stop_comments_and_every_note_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let db = RunDb::open(&dir.path().join("runs.db")).unwrap();
    let n = start(&db, 1, "cosmics, HV at 1500 V");
    let note = |unix_ns, who: &str, kind: &str, text: &str| NoteRow {
        unix_ns,
        who: who.into(),
        kind: kind.into(),
        text: text.into(),
    };
    db.add_note(n, &note(5, "bob", "note", "crate 3 tripped, reset"))
        .unwrap();
    db.add_note(n, &note(9, "alice", "stop", "end of fill"))
        .unwrap();
    let r = db.get(n).unwrap();
    assert_eq!(r.summary.comment, "cosmics, HV at 1500 V");
    assert_eq!(
        r.notes,
        vec![
            note(1, "alice", "start", "cosmics, HV at 1500 V"),
            note(5, "bob", "note", "crate 3 tripped, reset"),
            note(9, "alice", "stop", "end of fill"),
        ]
    );
    assert!(matches!(
        db.add_note(n + 1, &note(1, "x", "note", "y")),
        Err(tessera_rundb::DbError::NoRun(_))
    ));
    assert!(matches!(
        db.add_note(n, &note(1, "x", "note", &"y".repeat(5000))),
        Err(tessera_rundb::DbError::CommentTooLong(5000))
    ));
    db.log_alarm_action(&AlarmActionRow {
        unix_ns: 7,
        who: "bob".into(),
        action: "silence".into(),
        alarm: "bottleneck".into(),
        subject: "recorder (disk)".into(),
        until_unix_ns: Some(607),
        run: Some(n),
    })
    .unwrap();
    let r = db.get(n).unwrap();
    assert_eq!(r.alarm_actions.len(), 1);
    assert_eq!(r.alarm_actions[0].until_unix_ns, Some(607));
    assert_eq!(db.alarm_actions(10).unwrap(), r.alarm_actions);
}

fn point(run: u64, unix_s: u64, events_per_s: f64, buffer: f64) -> HistoryPoint {
    HistoryPoint {
        run,
        unix_ns: unix_s * 1_000_000_000,
        span_s: 1.0,
        events_per_s,
        built_bytes_per_s: events_per_s * 100.0,
        recorded_bytes_per_s: 0.0,
        incomplete_per_s: 0.0,
        rejected_per_s: 0.0,
        dead_time_fraction: 0.0,
        buffer_fraction: buffer,
    }
}

#[test]
fn history_keeps_seconds_for_an_hour_then_averages_minutes_and_is_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let db = RunDb::open(&dir.path().join("runs.db")).unwrap();
    // Two hours of one run at 1 s, the rate equal to the minute it falls in; the buffer full
    // for one second of each minute.
    let t0 = 1_800_000_000 / 60 * 60; // a minute boundary
    let mut pts = Vec::new();
    for s in 0..7200u64 {
        pts.push(point(
            3,
            t0 + s,
            (s / 60) as f64,
            if s % 60 == 7 { 1.0 } else { 0.2 },
        ));
    }
    let now = (t0 + 7200) * 1_000_000_000;
    for chunk in pts.chunks(600) {
        db.add_history(chunk, now).unwrap();
    }
    let all = db.history(None, 0, u64::MAX, 100_000).unwrap();
    let (fine, coarse): (Vec<_>, Vec<_>) = all.iter().partition(|p| p.span_s == 1.0);
    assert_eq!(fine.len(), 3600, "the last hour at its own resolution");
    assert_eq!(coarse.len(), 60, "the hour before in minutes");
    for (i, p) in coarse.iter().enumerate() {
        assert_eq!(p.span_s, 60.0);
        assert_eq!(p.unix_ns, (t0 + 60 * i as u64) * 1_000_000_000);
        assert_eq!(p.events_per_s, i as f64, "a minute's mean");
        assert_eq!(p.built_bytes_per_s, i as f64 * 100.0);
        assert_eq!(p.buffer_fraction, 1.0, "the fullest moment is kept");
    }
    // Oldest first; the limit keeps the newest.
    assert!(all.windows(2).all(|w| w[0].unix_ns < w[1].unix_ns));
    let last = db.history(Some((3, 3)), 0, u64::MAX, 10).unwrap();
    assert_eq!(last.len(), 10);
    assert_eq!(last[9].unix_ns, (t0 + 7199) * 1_000_000_000);
    assert!(db
        .history(Some((4, 9)), 0, u64::MAX, 10)
        .unwrap()
        .is_empty());
    // A day later the minutes become ten minutes; past the days kept, nothing is left.
    db.add_history(&[], now + 2 * 86_400 * 1_000_000_000)
        .unwrap();
    let all = db.history(None, 0, u64::MAX, 100_000).unwrap();
    assert_eq!(all.len(), 12, "two hours in ten-minute points");
    assert!(all.iter().all(|p| p.span_s == 600.0));
    assert_eq!(all[0].events_per_s, 4.5, "the mean of minutes 0..10");
    db.add_history(&[], now + 401 * 86_400 * 1_000_000_000)
        .unwrap();
    assert!(db.history(None, 0, u64::MAX, 100_000).unwrap().is_empty());
}

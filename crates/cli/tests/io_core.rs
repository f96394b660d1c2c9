//! Issue 14: the threads of a running system follow the cores, not the connections. Links from
//! sources into readout units and from readout units into builders are served by the process's
//! I/O pollers; a thread per link would put 240 reader threads into this run.

mod support;
use std::process::Command;
use std::time::Duration;
use support::{eventually, has_part, Proc, LIMIT};

fn threads_of(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn two_hundred_links_are_read_by_a_few_pollers_and_every_fragment_is_accounted() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("data");
    let cfg = dir.path().join("t.toml");
    // 4 readout units x 50 sources, 10 builders: 200 source links and 40 unit-to-builder links.
    let mut t = String::from(
        "[run]\nmax_fragment_size = \"4 KiB\"\n[sources]\ncount = 200\nfragment_size = 256\n\
         trigger = \"periodic\"\nrate_hz = 200\n[recorder]\nfsync = false\n[monitor]\nenabled = false\n",
    );
    for r in 0..4 {
        t += &format!(
            "[[readout]]\nid = {r}\nsources = \"{}-{}\"\n",
            50 * r,
            50 * r + 49
        );
    }
    for b in 0..10 {
        t += &format!("[[builder]]\nid = {b}\n");
    }
    std::fs::write(&cfg, t).unwrap();
    let run = run_on_two_pollers(&cfg, &out, &["--duration", "600"]);
    assert!(
        eventually(Duration::from_secs(60), || has_part(&out)),
        "no data reached the recorder"
    );
    let threads = threads_of(run.id());
    eprintln!("threads while running: {threads}");
    run.signal("TERM");
    let (report, text) = report_of(run);
    // Per readout unit: accept, sweep, one sender per builder; per builder: accept, sweep,
    // recorder link; the recorder's pipeline; 2 x 2 pollers; source drivers; run control:
    // about a hundred (105 when this was written). A thread per source link alone would be 200.
    assert!(
        threads < 200,
        "{threads} threads for 200 source links: links have threads of their own"
    );
    assert_eq!(report["balance"]["holds"], true, "{text}");
    assert!(report["events_complete"].as_u64().unwrap() > 0, "{text}");
    assert_eq!(report["events_incomplete"], 0, "{text}");
}

/// Two pollers serve both readout units' links, and a builder keeps only two read chunks per
/// link (a few super-fragments). A unit's batches of departed events must reach its builder
/// queues in the order they left its assembler: when two pollers raced there, a later batch
/// overtook an earlier one, a builder filled one link with events the other unit had not sent
/// yet while that unit's link held the ones it lacked, and no link could read again. Nothing
/// timed out (both units alive and held) and the run stood still: four runs of four like this
/// one before the fix.
#[test]
fn builders_with_two_read_chunks_per_link_build_every_event_of_two_polled_units() {
    tight_builders_build_every_event("buffer = \"1 MiB\"\n");
}

/// The same with two rails per builder (two connections from each unit, its super-fragments
/// dealt over them), each rail with two read chunks. The rails of a link shared one budget:
/// one rail took it all with events the other unit had not sent yet while its sibling, holding
/// the events that unit had sent, could not read, and the run stood still (three runs of
/// three before each rail had memory of its own).
#[test]
fn builders_with_two_read_chunks_per_rail_build_every_event_of_two_polled_units() {
    tight_builders_build_every_event("buffer = \"2 MiB\"\nrails = [\"127.0.0.1:0\"]\n");
}

/// Runs 20 000 events of 16 KiB x 8 over two readout units (2 MiB each) and two builders
/// (`builder` keys, read chunks of 256 KiB) on two pollers per stage.
fn tight_builders_build_every_event(builder: &str) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("data");
    let cfg = dir.path().join("t.toml");
    let mut t = String::from(
        "[run]\nevents = 20000\nmax_fragment_size = \"16 KiB\"\n\
         [sources]\ncount = 8\nfragment_size = 16384\ntrigger = \"unlimited\"\nthreads = 2\n\
         [recorder]\nenabled = false\n[monitor]\nenabled = false\n",
    );
    for r in 0..2 {
        t += &format!("[[readout]]\nid = {r}\nbuffer = \"2 MiB\"\n");
    }
    for b in 0..2 {
        t += &format!("[[builder]]\nid = {b}\nread_chunk = \"256 KiB\"\n{builder}");
    }
    std::fs::write(&cfg, t).unwrap();
    let (report, text) = report_of(run_on_two_pollers(&cfg, &out, &[]));
    assert_eq!(report["balance"]["holds"], true, "{text}");
    assert_eq!(report["events_complete"], 20000, "{text}");
    assert_eq!(report["events_incomplete"], 0, "{text}");
}

/// `tessera run CONFIG --output OUT --json --quiet --http off ARGS` with two pollers per stage.
fn run_on_two_pollers(cfg: &std::path::Path, out: &std::path::Path, args: &[&str]) -> Proc {
    Proc::spawn_piped(
        Command::new(env!("CARGO_BIN_EXE_tessera"))
            .env("TESSERA_IO_THREADS", "2")
            .arg("run")
            .arg(cfg)
            .arg("--output")
            .arg(out)
            .args(["--json", "--quiet", "--http", "off"])
            .args(args),
    )
}

/// The run's JSON report once it has exited successfully, and its text for messages.
fn report_of(run: Proc) -> (serde_json::Value, String) {
    let o = run.finish(LIMIT);
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let report = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {text}"));
    (report, text)
}

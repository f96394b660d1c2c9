//! `tessera bench instructions`: the cost of building one fragment in instructions, counted by
//! valgrind's callgrind, the one cost figure that repeats exactly on a shared, noisy machine.
//! The binary itself runs the same push-mode topology twice under callgrind (1 KiB × 8 sources,
//! two readout units, two builders, recorder and monitor off, event timeouts long enough that
//! valgrind's slowness makes nothing late), for a short and a long run; the difference of the
//! two totals over the difference of their fragments is the cost per fragment, start-up and
//! shut-down cancelled out. The emulated sources (payload pattern, encoding with CRC) are
//! included, as in issue 14's figure.

use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::path::Path;
use std::process::Command;

use crate::BenchArgs;

#[derive(Debug, Serialize)]
pub struct Instructions {
    pub fragment_size: u64,
    pub sources: u32,
    pub events_short: u64,
    pub events_long: u64,
    /// The totals of the pair whose cost per fragment is the median.
    pub instructions_short: u64,
    pub instructions_long: u64,
    /// The median over the pairs.
    pub instructions_per_fragment: f64,
    pub min_per_fragment: f64,
    pub max_per_fragment: f64,
    /// Every pair, in the order run.
    pub pairs: Vec<Pair>,
}

/// One short and one long run under callgrind.
#[derive(Clone, Debug, Serialize)]
pub struct Pair {
    pub instructions_short: u64,
    pub instructions_long: u64,
    pub instructions_per_fragment: f64,
}

fn topology(events: u64, size: u64, sources: u32) -> String {
    let half = sources / 2;
    format!(
        "[run]\nevents = {events}\n[sources]\ncount = {sources}\nfragment_size = {size}\n\
         trigger = \"unlimited\"\n\
         [[readout]]\nid = 0\nsources = \"0-{}\"\nevent_timeout_ms = 600000\n\
         [[readout]]\nid = 1\nsources = \"{half}-{}\"\nevent_timeout_ms = 600000\n\
         [[builder]]\nid = 0\nevent_timeout_ms = 900000\n\
         [[builder]]\nid = 1\nevent_timeout_ms = 900000\n\
         [recorder]\nenabled = false\n[monitor]\nenabled = false\n",
        half - 1,
        sources - 1
    )
}

/// `Collected : N` from callgrind's summary.
fn collected(stderr: &str) -> Option<u64> {
    stderr
        .lines()
        .find_map(|l| l.split("Collected :").nth(1))
        .and_then(|n| n.trim().parse().ok())
}

fn counted(dir: &Path, events: u64, size: u64, sources: u32) -> Result<u64> {
    let cfg = dir.join(format!("run{events}.toml"));
    std::fs::write(&cfg, topology(events, size, sources))?;
    let exe = std::env::current_exe().context("finding this binary")?;
    let o = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!(
            "--callgrind-out-file={}",
            dir.join(format!("callgrind.{events}.out")).display()
        ))
        .arg(&exe)
        .arg("run")
        .arg(&cfg)
        .arg("--output")
        .arg(dir.join(format!("out{events}")))
        .args(["--http", "off", "--quiet"])
        .output()
        .context("running valgrind (Debian's valgrind package)")?;
    let err = String::from_utf8_lossy(&o.stderr);
    if !o.status.success() {
        bail!("the run under callgrind failed: {err}");
    }
    // A run whose events went incomplete under valgrind's slowness measured something else.
    let out = String::from_utf8_lossy(&o.stdout);
    if !out.contains(", 0 incomplete)") {
        bail!("the run under callgrind built incomplete events: {out}");
    }
    collected(&err).with_context(|| format!("no instruction total from callgrind: {err}"))
}

pub fn run_instructions(a: &BenchArgs) -> Result<()> {
    let size = a
        .sizes
        .as_ref()
        .and_then(|s| s.first().copied())
        .unwrap_or(1024);
    let sources = a
        .sources
        .as_ref()
        .and_then(|s| s.first().copied())
        .unwrap_or(8)
        .max(2);
    let (short, long) = if a.quick {
        (5_000, 15_000)
    } else {
        (20_000, 60_000)
    };
    // Callgrind counts the same binary's instructions exactly, but how valgrind interleaves the
    // threads (how many events each batch carries) moves a pair's figure by a few percent: one
    // pair cannot tell a change of that size, the median of several can.
    let repeat = a.repeat.unwrap_or(if a.quick { 1 } else { 3 }).max(1);
    let dir = tempfile::tempdir()?;
    if !a.json {
        eprintln!(
            "instructions per fragment: {size} B x {sources} sources, {short} and {long} events under callgrind, {repeat} pair(s)"
        );
    }
    let frags = (long - short) * sources as u64;
    let mut pairs = Vec::with_capacity(repeat);
    for i in 0..repeat {
        let i_short = counted(dir.path(), short, size, sources)?;
        let i_long = counted(dir.path(), long, size, sources)?;
        let p = Pair {
            instructions_short: i_short,
            instructions_long: i_long,
            instructions_per_fragment: i_long.saturating_sub(i_short) as f64 / frags as f64,
        };
        if !a.json {
            eprintln!(
                "  pair {}/{repeat}: {:.0} ({i_long} - {i_short} over {frags} fragments)",
                i + 1,
                p.instructions_per_fragment
            );
        }
        pairs.push(p);
    }
    let mut sorted = pairs.clone();
    sorted.sort_by(|x, y| {
        x.instructions_per_fragment
            .total_cmp(&y.instructions_per_fragment)
    });
    let median = sorted[sorted.len() / 2].clone();
    let r = Instructions {
        fragment_size: size,
        sources,
        events_short: short,
        events_long: long,
        instructions_short: median.instructions_short,
        instructions_long: median.instructions_long,
        instructions_per_fragment: median.instructions_per_fragment,
        min_per_fragment: sorted[0].instructions_per_fragment,
        max_per_fragment: sorted[sorted.len() - 1].instructions_per_fragment,
        pairs,
    };
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "{:.0} instructions per fragment built (median of {repeat} pair(s), {:.0}-{:.0}; sources included)",
            r.instructions_per_fragment, r.min_per_fragment, r.max_per_fragment
        );
    }
    Ok(())
}

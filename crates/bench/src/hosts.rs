//! `tessera bench hosts`: building spread over hosts, each host a network namespace made here,
//! front-end links shaped to 1 Gb/s and the builder's link to 10 Gb/s with `tc` (token bucket),
//! against raw TCP over the same shaped links in the same run; and the same topology on one host
//! without shaping, over node agents against one process (what the agents and the run control
//! cost on the data path). Needs root and iproute2 (`ip netns`, `tc`).
//!
//! Hosts: `fe1..feN` each run a readout unit and its sources (the sources on loopback beside it,
//! as front-end boards on their own link), `be` runs the builder, which counts and drops (no
//! recorder: the point is building, not the disk). The run control runs on `be`.

use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::BenchArgs;
use tessera_scan::network::{self, Host, Link, TOKEN};

/// Front-end link rate (1 GbE) and the builder's (10 GbE), bits per second.
const FE_RATE: f64 = 1e9;
const BE_RATE: f64 = 10e9;

#[derive(Debug, Serialize)]
pub struct HostsPoint {
    /// `shaped` (namespaces, tc) or `one host` (loopback, no shaping).
    pub setting: String,
    pub front_ends: usize,
    pub sources_per_front_end: u32,
    pub fragment_size: u64,
    pub events: u64,
    /// Bytes the builder built per second over hosts (agents, run control).
    pub built_bytes_per_s: f64,
    /// The baseline in the same run: `shaped`: raw TCP over the same links, the same bytes per
    /// link; `one host`: the same topology in one process.
    pub baseline_bytes_per_s: f64,
    pub ratio: f64,
    /// Shaped: building as a fraction of the front-end links' summed line rate.
    pub line_rate_fraction: Option<f64>,
    /// Every event built, complete, and the balance holds.
    pub clean: bool,
}

/// The hosts `fe1..feN` (each sending at most 1 Gb/s) and `be` (receiving at most 10 Gb/s).
fn hosts_plan(front_ends: usize) -> Result<Vec<Host>> {
    let mut hosts: Vec<(String, Link)> = (1..=front_ends)
        .map(|i| (format!("fe{i}"), Link::up(FE_RATE)))
        .collect();
    hosts.push(("be".into(), Link::down(BE_RATE)));
    network::plan(&hosts)
}

/// Runs `f` on a thread inside network namespace `ns` (its sockets are that host's).
fn on_host<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> std::thread::JoinHandle<Result<T>> {
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        let fd = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
        use std::os::fd::AsRawFd;
        // SAFETY: setns on this thread only, with a namespace file descriptor held open.
        let r = unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) };
        if r != 0 {
            bail!("setns {path}: {}", std::io::Error::last_os_error());
        }
        f()
    })
}

/// Raw TCP over the shaped links: from every front end to a sink on `be`, `per_link` bytes
/// each, in 256 KiB writes; bytes per second at the sink, first write to last byte.
fn raw_tcp(hosts: &[Host], per_link: u64) -> Result<f64> {
    let (fes, be) = hosts.split_at(hosts.len() - 1);
    let be = &be[0];
    let n = fes.len();
    let listen = format!("{}:0", be.ip);
    let (tx, rx) = std::sync::mpsc::channel();
    let sink = on_host(&be.ns, move || {
        let l = TcpListener::bind(&listen)?;
        tx.send(l.local_addr()?)?;
        let mut readers = Vec::new();
        for _ in 0..n {
            let (mut s, _) = l.accept()?;
            readers.push(std::thread::spawn(move || -> u64 {
                let mut buf = vec![0u8; 256 << 10];
                let mut got = 0u64;
                while let Ok(k) = s.read(&mut buf) {
                    if k == 0 {
                        break;
                    }
                    got += k as u64;
                }
                got
            }));
        }
        let mut total = 0;
        for r in readers {
            total += r
                .join()
                .map_err(|_| anyhow::anyhow!("a sink thread panicked"))?;
        }
        Ok((total, Instant::now()))
    });
    let addr = rx.recv_timeout(Duration::from_secs(10))?;
    let t0 = Instant::now();
    let senders: Vec<_> = fes
        .iter()
        .map(|h| {
            on_host(&h.ns, move || {
                let mut s = TcpStream::connect(addr)?;
                let buf = vec![0x5au8; 256 << 10];
                let mut left = per_link;
                while left > 0 {
                    let k = left.min(buf.len() as u64) as usize;
                    s.write_all(&buf[..k])?;
                    left -= k as u64;
                }
                s.shutdown(std::net::Shutdown::Write)?;
                Ok(())
            })
        })
        .collect();
    for s in senders {
        s.join()
            .map_err(|_| anyhow::anyhow!("a sender thread panicked"))??;
    }
    let (total, end) = sink
        .join()
        .map_err(|_| anyhow::anyhow!("the sink thread panicked"))??;
    Ok(total as f64 / (end - t0).as_secs_f64().max(1e-9))
}

/// This `tessera` binary, run in namespace `ns` or here.
fn tessera_on(ns: Option<&str>) -> Result<Command> {
    Ok(network::command_on(ns, &std::env::current_exe()?))
}

struct Plan {
    front_ends: usize,
    sources: u32,
    size: u64,
    events: u64,
}

fn topology(p: &Plan, out: &Path, hosts: Option<&[(String, String)]>, allow: bool) -> String {
    let n = p.front_ends as u32 * p.sources;
    let mut t = format!(
        "[run]\nevents = {}\noutput = \"{}\"\nmax_fragment_size = {}\n\
         [sources]\ncount = {n}\nfragment_size = {}\ntrigger = \"unlimited\"\nthreads = 2\n\
         [recorder]\nenabled = false\n[control]\nlisten = \"\"\nagent_timeout_ms = 10000\n\
         [[builder]]\nid = 0\n{}",
        p.events,
        out.display(),
        p.size.max(1024),
        p.size,
        if hosts.is_some() {
            "host = \"be\"\n"
        } else {
            ""
        }
    );
    if allow {
        t += "[security]\nallow = [\"10.79.0.0/24\"]\n";
    }
    for i in 0..p.front_ends as u32 {
        t += &format!(
            "[[readout]]\nid = {i}\nsources = \"{}-{}\"\n{}",
            i * p.sources,
            (i + 1) * p.sources - 1,
            if hosts.is_some() {
                format!("host = \"fe{}\"\n", i + 1)
            } else {
                String::new()
            }
        );
    }
    if let Some(h) = hosts {
        t += "[hosts]\n";
        for (name, addr) in h {
            t += &format!("{name} = \"{addr}\"\n");
        }
    }
    t
}

/// Runs the topology at `cfg` through `tessera run` (in `ns` if given) and returns its report.
fn run_control(ns: Option<&str>, cfg: &Path) -> Result<serde_json::Value> {
    let o = tessera_on(ns)?
        .arg("run")
        .arg(cfg)
        .args(["--json", "--quiet", "--http", "off"])
        .env("TESSERA_TOKEN", TOKEN)
        .env_remove("TESSERA_LOG")
        .output()
        .context("running tessera run")?;
    if !o.status.success() {
        bail!(
            "tessera run over hosts failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    serde_json::from_slice(&o.stdout).context("the run's report")
}

fn built(rep: &serde_json::Value, events: u64) -> (f64, bool) {
    let secs = rep["duration_s"].as_f64().unwrap_or(0.0).max(1e-9);
    let bytes = rep["bytes_built"].as_u64().unwrap_or(0) as f64;
    let complete = rep["events_complete"].as_u64().unwrap_or(0);
    let clean = rep["balance"]["holds"] == true && complete == events;
    (bytes / secs, clean)
}

pub fn run_hosts(a: &BenchArgs) -> Result<()> {
    let front_ends = 3;
    let sources = 4;
    let sizes = a.sizes.clone().unwrap_or_else(|| {
        if a.quick {
            vec![4096]
        } else {
            vec![1024, 4096, 16384]
        }
    });
    // Enough for a few seconds at the shaped line rate.
    let bytes = a.bytes.unwrap_or(if a.quick { 0.4e9 } else { 1.5e9 });
    let dir = tempfile::tempdir()?;
    if !a.json {
        eprintln!(
            "tessera bench hosts: {front_ends} front ends x {sources} sources -> 1 builder; shaped: front-end links {} Gb/s, builder link {} Gb/s (tc tbf)",
            FE_RATE / 1e9,
            BE_RATE / 1e9
        );
        println!(
            "{:<9} {:>9} {:>9} {:>11} {:>13} {:>7} {:>10} {:>5}",
            "setting",
            "fragment",
            "events",
            "built MB/s",
            "baseline MB/s",
            "ratio",
            "line rate",
            "clean"
        );
    }
    let exe = std::env::current_exe()?;
    let running = network::Running::start(
        hosts_plan(front_ends)?,
        &exe,
        dir.path(),
        "tessera bench hosts",
    )?;
    let hosts = running.hosts.clone();
    let entries: Vec<(String, String)> =
        hosts.iter().map(|h| (h.name.clone(), h.agent())).collect();
    for &size in &sizes {
        let wire = tessera_format::wire::fragment_wire_size(size as usize) as u64;
        let events =
            ((bytes / (wire * (front_ends as u64) * sources as u64) as f64) as u64).max(1000);
        let plan = Plan {
            front_ends,
            sources,
            size,
            events,
        };
        // Shaped: raw TCP first, then building, on the same links.
        let per_link = events * sources as u64 * wire;
        let base = raw_tcp(&hosts, per_link)?;
        let cfg = dir.path().join(format!("shaped{size}.toml"));
        std::fs::write(
            &cfg,
            topology(&plan, &dir.path().join("control"), Some(&entries), true),
        )?;
        let rep = run_control(Some(&hosts[hosts.len() - 1].ns), &cfg)?;
        let (bps, clean) = built(&rep, events);
        print_point(
            a,
            &HostsPoint {
                setting: "shaped".into(),
                front_ends,
                sources_per_front_end: sources,
                fragment_size: size,
                events,
                built_bytes_per_s: bps,
                baseline_bytes_per_s: base,
                ratio: bps / base.max(1e-9),
                line_rate_fraction: Some(bps / (front_ends as f64 * FE_RATE / 8.0)),
                clean,
            },
        )?;
    }
    drop(running);
    // One host, no shaping: the same topology over agents on loopback against one process.
    let mut procs = Vec::new();
    let mut entries = Vec::new();
    for h in hosts.iter().map(|h| &h.name) {
        let (p, addr) = network::agent(
            &exe,
            None,
            "127.0.0.1:0",
            &dir.path().join(format!("local-{h}")),
        )?;
        procs.push(p);
        entries.push((h.clone(), addr));
    }
    for &size in &sizes {
        let wire = tessera_format::wire::fragment_wire_size(size as usize) as u64;
        // Loopback is an order of magnitude faster: move more, so startup weighs the same.
        let events =
            ((4.0 * bytes / (wire * (front_ends as u64) * sources as u64) as f64) as u64).max(1000);
        let plan = Plan {
            front_ends,
            sources,
            size,
            events,
        };
        let one = dir.path().join(format!("one{size}.toml"));
        std::fs::write(&one, topology(&plan, &dir.path().join("one"), None, false))?;
        let rep1 = run_control(None, &one)?;
        let (base, clean1) = built(&rep1, events);
        let cfg = dir.path().join(format!("local{size}.toml"));
        std::fs::write(
            &cfg,
            topology(&plan, &dir.path().join("local"), Some(&entries), false),
        )?;
        let rep = run_control(None, &cfg)?;
        let (bps, clean) = built(&rep, events);
        print_point(
            a,
            &HostsPoint {
                setting: "one host".into(),
                front_ends,
                sources_per_front_end: sources,
                fragment_size: size,
                events,
                built_bytes_per_s: bps,
                baseline_bytes_per_s: base,
                ratio: bps / base.max(1e-9),
                line_rate_fraction: None,
                clean: clean && clean1,
            },
        )?;
    }
    drop(procs);
    Ok(())
}

fn print_point(a: &BenchArgs, p: &HostsPoint) -> Result<()> {
    if a.json {
        println!("{}", serde_json::to_string(p)?);
    } else {
        println!(
            "{:<9} {:>9} {:>9} {:>11.1} {:>13.1} {:>7.2} {:>10} {:>5}",
            p.setting,
            p.fragment_size,
            p.events,
            p.built_bytes_per_s / 1e6,
            p.baseline_bytes_per_s / 1e6,
            p.ratio,
            p.line_rate_fraction
                .map_or("-".into(), |f| format!("{:.2}", f)),
            if p.clean { "yes" } else { "NO" }
        );
    }
    Ok(())
}

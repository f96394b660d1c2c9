//! Emulated hosts on this machine: one network namespace per host, joined by a bridge in a
//! switch namespace, links shaped with `tc` (token bucket) to the rates of the seeds' networks,
//! and a node agent (`tessera node`) in each. `tessera scenario --network` runs a seed's
//! experiment over them; `tessera bench hosts` measures building over them against raw TCP.
//! Needs root and iproute2 (`ip netns`, `tc`).
//!
//! The namespaces share this machine's cores: shaping makes a link as narrow as the seed's, it
//! does not give each host CPUs of its own.

use anyhow::{bail, Context, Result};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The hosts' network: host i is `10.79.0.(10+i)`. Namespaces are private to a run (their names
/// carry the process ID), so two runs may use the same addresses at once.
pub const SUBNET: &str = "10.79.0.0/24";
/// The port each node agent listens on, inside its own namespace.
pub const AGENT_PORT: u16 = 7300;
/// The token the agents and the run control share (`TESSERA_TOKEN`): the namespaces are
/// reachable from nothing but this machine's root.
pub const TOKEN: &str = "tessera-emulated-hosts";
/// The most hosts one network holds (addresses .10 to .250).
pub const MAX_HOSTS: usize = 240;

/// A host's link to the switch, each direction capped at a rate in bits per second (`None`:
/// the veth's own speed).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Link {
    /// What the host sends (shaped on its own side of the veth).
    pub up_bps: Option<f64>,
    /// What the host receives (shaped on the switch's side).
    pub down_bps: Option<f64>,
}

/// One emulated host: its name in the topology's `[hosts]`, its namespace and its address.
#[derive(Clone, Debug)]
pub struct Host {
    pub name: String,
    pub ns: String,
    pub ip: String,
    pub link: Link,
}

impl Host {
    /// The node agent's address, as `[hosts]` names it.
    pub fn agent(&self) -> String {
        format!("{}:{AGENT_PORT}", self.ip)
    }
}

/// The addresses hosts get, in the order given, before anything exists (a topology that names
/// them can be written and checked first); their namespaces are named when they are made.
pub fn plan(hosts: &[(String, Link)]) -> Result<Vec<Host>> {
    if hosts.len() > MAX_HOSTS {
        bail!(
            "{} emulated hosts: at most {MAX_HOSTS} fit the network {SUBNET}",
            hosts.len()
        );
    }
    Ok(hosts
        .iter()
        .enumerate()
        .map(|(i, (name, link))| Host {
            name: name.clone(),
            ns: String::new(),
            ip: format!("10.79.0.{}", 10 + i),
            link: *link,
        })
        .collect())
}

/// A prefix for a new set of namespaces: the process and how many sets it made before (short:
/// interface names take it too, and Linux allows 15 characters).
fn tag() -> String {
    static SETS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    format!(
        "tn{}x{}",
        std::process::id() % 100_000,
        SETS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 100
    )
}

/// The namespaces made, removed (with every process still in them gone first) when dropped.
pub struct Net {
    names: Vec<String>,
}

impl Drop for Net {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

fn run_cmd(args: &[&str]) -> Result<()> {
    let o = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("running {}", args[0]))?;
    if !o.status.success() {
        bail!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    Ok(())
}

/// A token bucket on `dev` in `ns`: at most `bps`, with bursts of about 4 ms at that rate (what
/// a NIC's queue lets through at once), at least 64 KiB so that one large segment passes.
fn shape(ns: &str, dev: &str, bps: f64) -> Result<()> {
    let rate = format!("{}bit", bps.round() as u64);
    let burst = format!("{}", ((bps / 8.0 * 0.004) as u64).max(64 << 10));
    run_cmd(&[
        "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", &rate,
        "burst", &burst, "latency", "20ms",
    ])
}

/// Makes the planned hosts: a namespace each (named here), a veth to a bridge in a switch
/// namespace, its address, and its link shaped.
pub fn make(hosts: &mut [Host], what: &str) -> Result<Net> {
    if hosts.is_empty() {
        bail!("no hosts to make");
    }
    let tag = tag();
    let mut net = Net { names: Vec::new() };
    let sw = format!("{tag}sw");
    run_cmd(&["ip", "netns", "add", &sw]).with_context(|| {
        format!("{what} makes network namespaces: run it as root with iproute2 installed")
    })?;
    net.names.push(sw.clone());
    run_cmd(&["ip", "-n", &sw, "link", "add", "sw0", "type", "bridge"])?;
    run_cmd(&["ip", "-n", &sw, "link", "set", "sw0", "up"])?;
    for (i, h) in hosts.iter_mut().enumerate() {
        h.ns = format!("{tag}h{i}");
        run_cmd(&["ip", "netns", "add", &h.ns])?;
        net.names.push(h.ns.clone());
        let (hv, sv) = (format!("{tag}v{i}"), format!("{tag}s{i}"));
        for st in [
            vec!["ip", "-n", &h.ns, "link", "set", "lo", "up"],
            vec![
                "ip", "link", "add", &hv, "type", "veth", "peer", "name", &sv,
            ],
            vec!["ip", "link", "set", &hv, "netns", &h.ns],
            vec!["ip", "link", "set", &sv, "netns", &sw],
            vec!["ip", "-n", &sw, "link", "set", &sv, "master", "sw0", "up"],
        ] {
            run_cmd(&st)?;
        }
        let cidr = format!("{}/24", h.ip);
        run_cmd(&["ip", "-n", &h.ns, "addr", "add", &cidr, "dev", &hv])?;
        run_cmd(&["ip", "-n", &h.ns, "link", "set", &hv, "up"])?;
        if let Some(bps) = h.link.up_bps {
            shape(&h.ns, &hv, bps)?;
        }
        if let Some(bps) = h.link.down_bps {
            shape(&sw, &sv, bps)?;
        }
    }
    Ok(net)
}

/// A child process, killed if still there when dropped.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `binary` run in namespace `ns` (`ip netns exec`), or here.
pub fn command_on(ns: Option<&str>, binary: &Path) -> Command {
    match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(binary);
            c
        }
        None => Command::new(binary),
    }
}

/// Starts a node agent of `binary` listening on `listen` (in `ns` if given), its files under
/// `out`; returns it and the address it said it listens on.
pub fn agent(binary: &Path, ns: Option<&str>, listen: &str, out: &Path) -> Result<(Proc, String)> {
    let mut c = command_on(ns, binary);
    c.args(["node", "--listen", listen, "--output"])
        .arg(out)
        .env("TESSERA_TOKEN", TOKEN)
        .env_remove("TESSERA_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = c.spawn().context("starting a node agent")?;
    // It says where it listens on its first line.
    let mut err = child.stderr.take().context("the agent's stderr")?;
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while err.read(&mut b)? == 1 && b[0] != b'\n' {
        line.push(b[0]);
    }
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    let line = String::from_utf8_lossy(&line).to_string();
    let addr = line
        .rsplit(' ')
        .next()
        .filter(|a| a.contains(':'))
        .with_context(|| format!("the agent said {line:?}"))?
        .to_string();
    Ok((Proc(child), addr))
}

/// Hosts made and an agent running on each, all gone when dropped (agents first).
pub struct Running {
    pub hosts: Vec<Host>,
    agents: Vec<Proc>,
    net: Option<Net>,
    /// Where the agents keep their files.
    pub output: PathBuf,
}

impl Running {
    /// Makes the hosts and starts `binary`'s node agent on each, at its planned address.
    pub fn start(
        mut hosts: Vec<Host>,
        binary: &Path,
        output: &Path,
        what: &str,
    ) -> Result<Running> {
        let net = make(&mut hosts, what)?;
        let mut agents = Vec::new();
        for h in &hosts {
            let (p, addr) = agent(binary, Some(&h.ns), &h.agent(), &output.join(&h.name))
                .with_context(|| format!("the node agent of host {}", h.name))?;
            if addr != h.agent() {
                bail!(
                    "the agent of host {} listens on {addr}, not {}",
                    h.name,
                    h.agent()
                );
            }
            agents.push(p);
        }
        Ok(Running {
            hosts,
            agents,
            net: Some(net),
            output: output.to_path_buf(),
        })
    }

    /// The namespace of host `name`.
    pub fn ns(&self, name: &str) -> Option<&str> {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .map(|h| h.ns.as_str())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.agents.clear();
        self.net.take();
    }
}

/// Where a role's processes run: on host `host`, or, with `each`, one host per role
/// (`host1`, `host2`, ...) or round a fixed number of them.
#[derive(Clone, Debug)]
pub struct Group {
    pub host: &'static str,
    /// 0: every role on `host`; n: the roles round the hosts `host1`..`hostn` (`usize::MAX`:
    /// a host per role).
    pub spread: usize,
    pub link: Link,
}

impl Group {
    /// All roles of the group on one host.
    pub fn one(host: &'static str, link: Link) -> Group {
        Group {
            host,
            spread: 0,
            link,
        }
    }

    /// A host for each role of the group.
    pub fn each(host: &'static str, link: Link) -> Group {
        Group {
            host,
            spread: usize::MAX,
            link,
        }
    }

    fn host_of(&self, i: usize) -> String {
        match self.spread {
            0 => self.host.to_string(),
            n => format!("{}{}", self.host, i % n + 1),
        }
    }
}

/// A seed's network: where each role runs and each host's link. Hosts named by two groups are
/// one host (the first group's link).
#[derive(Clone, Debug)]
pub struct Network {
    /// The network in a sentence, for the report.
    pub about: &'static str,
    /// The emulated sources' host (`None`: each source beside its readout unit).
    pub sources: Option<Group>,
    pub readout: Group,
    pub builder: Group,
    /// The run control, the event manager and the recorder (and its monitor).
    pub control: Group,
}

impl Network {
    /// A two-layer network of `tessera scan --network`: each readout unit on a host of its own
    /// (`fe1`, `fe2`, ...) sending at most `front_gbps`, each builder on its own (`bu1`, ...)
    /// receiving at most `back_gbps`, the rest on `control`.
    pub fn front_and_back(front_gbps: f64, back_gbps: f64) -> Result<Network> {
        for (what, g) in [("front-end", front_gbps), ("back-end", back_gbps)] {
            if !(g.is_finite() && (0.001..=400.0).contains(&g)) {
                bail!("the {what} link: {g} Gb/s is not a rate from 0.001 to 400 Gb/s");
            }
        }
        Ok(Network {
            about: "each readout unit on a host of its own with its sources, each builder on its own, the run control, event manager and recorder on another",
            sources: None,
            readout: Group::each("fe", Link::up(front_gbps * 1e9)),
            builder: Group::each("bu", Link::down(back_gbps * 1e9)),
            control: Group::one("control", Link::default()),
        })
    }
}

fn count(doc: &toml_edit::DocumentMut, name: &str) -> usize {
    doc.get(name)
        .and_then(|i| i.as_array_of_tables())
        .map_or(0, |a| a.len())
}

impl Network {
    /// The hosts a topology needs, in order: the control host first.
    pub fn hosts(&self, doc: &toml_edit::DocumentMut) -> Vec<(String, Link)> {
        let mut out: Vec<(String, Link)> = Vec::new();
        let mut add = |name: String, link: Link| {
            if !out.iter().any(|h| h.0 == name) {
                out.push((name, link));
            }
        };
        add(self.control.host_of(0), self.control.link);
        if let Some(s) = &self.sources {
            add(s.host_of(0), s.link);
        }
        for i in 0..count(doc, "readout") {
            add(self.readout.host_of(i), self.readout.link);
        }
        for i in 0..count(doc, "builder") {
            add(self.builder.host_of(i), self.builder.link);
        }
        out
    }

    /// The event rate at which the first shaped link is full, for events of `event_bytes`
    /// spread evenly over the readout units' and the builders' hosts (`None`: no shaped link
    /// between two hosts carries the data). Headers are left out: the links carry a little more.
    pub fn limit_hz(&self, doc: &toml_edit::DocumentMut, event_bytes: f64) -> Option<f64> {
        if event_bytes <= 0.0 {
            return None;
        }
        let hosts = |g: &Group, n: usize| -> Vec<String> {
            let mut v: Vec<String> = (0..n).map(|i| g.host_of(i)).collect();
            v.sort();
            v.dedup();
            v
        };
        let rus = hosts(&self.readout, count(doc, "readout"));
        let bus = hosts(&self.builder, count(doc, "builder"));
        let mut limits = Vec::new();
        // A link carries its hosts' share: bits per second over 8, times the hosts, per event.
        let mut cap = |bps: Option<f64>, n: usize| {
            if let Some(b) = bps {
                limits.push(b / 8.0 * n as f64 / event_bytes);
            }
        };
        if let Some(s) = &self.sources {
            if !rus.contains(&s.host_of(0)) {
                cap(s.link.up_bps, 1);
                cap(self.readout.link.down_bps, rus.len());
            }
        }
        if rus.iter().all(|h| !bus.contains(h)) {
            cap(self.readout.link.up_bps, rus.len());
            cap(self.builder.link.down_bps, bus.len());
        }
        limits.into_iter().reduce(f64::min)
    }

    /// The host the run control runs on.
    pub fn control_host(&self) -> String {
        self.control.host_of(0)
    }

    /// Places every role of `doc` on its host, and names the hosts' agents in `[hosts]`.
    pub fn place(&self, doc: &mut toml_edit::DocumentMut, hosts: &[Host]) -> Result<()> {
        let q = |s: &str| format!("\"{s}\"");
        for i in 0..count(doc, "readout") {
            crate::set_key(
                doc,
                &format!("readout[{i}].host"),
                &q(&self.readout.host_of(i)),
            )?;
        }
        for i in 0..count(doc, "builder") {
            crate::set_key(
                doc,
                &format!("builder[{i}].host"),
                &q(&self.builder.host_of(i)),
            )?;
        }
        let control = q(&self.control.host_of(0));
        crate::set_key(doc, "recorder.host", &control)?;
        crate::set_key(doc, "event_manager.host", &control)?;
        if let Some(s) = &self.sources {
            crate::set_key(doc, "sources.host", &q(&s.host_of(0)))?;
        }
        for h in hosts {
            crate::set_key(doc, &format!("hosts.{}", h.name), &q(&h.agent()))?;
        }
        crate::set_key(doc, "security.allow", &format!("[\"{SUBNET}\"]"))?;
        // Two cores shared by every host's agent: a saturated point can keep an agent from
        // answering for longer than the default allows.
        crate::set_key(doc, "control.agent_timeout_ms", "10000")?;
        Ok(())
    }
}

/// A rate in bits per second as a network engineer says it (`1 Gb/s`, `2.5 Gb/s`).
pub fn rate(bps: f64) -> String {
    if bps >= 1e9 {
        format!("{} Gb/s", crate::plot::short(bps / 1e9))
    } else {
        format!("{} Mb/s", crate::plot::short(bps / 1e6))
    }
}

/// A link's caps for a line of text: ` (up 1 Gb/s, down 10 Gb/s)`, or nothing when unshaped.
pub fn describe_link(l: &Link) -> String {
    let mut parts = Vec::new();
    if let Some(b) = l.up_bps {
        parts.push(format!("sends at most {}", rate(b)));
    }
    if let Some(b) = l.down_bps {
        parts.push(format!("receives at most {}", rate(b)));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(" ({})", parts.join(", "))
    }
}

impl Link {
    pub fn up(bps: f64) -> Link {
        Link {
            up_bps: Some(bps),
            down_bps: None,
        }
    }
    pub fn down(bps: f64) -> Link {
        Link {
            up_bps: None,
            down_bps: Some(bps),
        }
    }
    pub fn both(bps: f64) -> Link {
        Link {
            up_bps: Some(bps),
            down_bps: Some(bps),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_are_placed_on_their_groups_hosts() {
        let mut doc: toml_edit::DocumentMut =
            "[[readout]]\nid = 0\n[[readout]]\nid = 1\n[[builder]]\nid = 0\n[[builder]]\nid = 1\n[[builder]]\nid = 2\n"
                .parse()
                .unwrap();
        let n = Network {
            about: "",
            sources: None,
            readout: Group::each("ru", Link::up(2e9)),
            builder: Group {
                host: "bu",
                spread: 2,
                link: Link::down(20e9),
            },
            control: Group::one("evm", Link::default()),
        };
        let names: Vec<String> = n.hosts(&doc).into_iter().map(|h| h.0).collect();
        assert_eq!(names, ["evm", "ru1", "ru2", "bu1", "bu2"]);
        let hosts = plan(&n.hosts(&doc)).unwrap();
        assert_eq!(hosts[1].link, Link::up(2e9));
        assert_eq!(hosts[3].agent(), "10.79.0.13:7300");
        n.place(&mut doc, &hosts).unwrap();
        let t = doc.to_string();
        let v: toml::Value = toml::from_str(&t).unwrap();
        assert_eq!(v["builder"][2]["host"].as_str(), Some("bu1"));
        assert_eq!(v["readout"][1]["host"].as_str(), Some("ru2"));
        assert_eq!(v["hosts"]["bu2"].as_str(), Some("10.79.0.14:7300"));
        assert_eq!(v["recorder"]["host"].as_str(), Some("evm"));
        // 2 hosts sending at most 2 Gb/s each: 500 MB/s of events; the builders' 2 x 20 Gb/s
        // are wider.
        let hz = n.limit_hz(&doc, 1e6).unwrap();
        assert!((hz - 500.0).abs() < 1e-9, "{hz}");
        // Everything on one host: no link between hosts carries the data.
        let one = Network {
            about: "",
            sources: None,
            readout: Group::one("pc", Link::down(1e9)),
            builder: Group::one("pc", Link::default()),
            control: Group::one("pc", Link::default()),
        };
        assert_eq!(one.limit_hz(&doc, 1e6), None);
        let many: Vec<(String, Link)> = (0..=MAX_HOSTS)
            .map(|i| (format!("h{i}"), Link::default()))
            .collect();
        assert!(plan(&many).is_err());
    }
}

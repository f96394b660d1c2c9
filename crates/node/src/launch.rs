//! `tessera launch`: starts the node agent of every host of `[hosts]` that has none running,
//! over OpenSSH, as a site without systemd units or Kubernetes would. The token goes to the
//! remote agent on its standard input, never on a command line (where `ps` would show it).

use anyhow::{bail, Context, Result};
use std::io::Write;
use std::net::{TcpStream, ToSocketAddrs};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tessera_config::Resolved;

/// How to reach the hosts and what to start there.
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    /// The ssh command and its options, split on whitespace (e.g. `ssh -i key -o BatchMode=yes`).
    pub ssh: String,
    /// The `tessera` binary on the hosts.
    pub binary: String,
    /// The agents' output directory (`--output`), if not the topology's.
    pub output: Option<String>,
    /// Where each agent's log goes on its host.
    pub log: String,
    pub token: String,
    /// How long an agent may take to answer after its start.
    pub patience: Duration,
    /// The agents' certificate and key (`--tls-certificate`, `--tls-key`), paths on the hosts;
    /// `{host}` in them is replaced by each host's name in `[hosts]`.
    pub tls: Option<(String, String)>,
}

/// One host's outcome.
#[derive(Debug)]
pub struct Launched {
    pub host: String,
    pub agent: String,
    /// The agent's process ID on its host; `None`: one was already running.
    pub pid: Option<u32>,
}

fn answers(addr: &str) -> bool {
    addr.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .is_some_and(|a| TcpStream::connect_timeout(&a, Duration::from_millis(500)).is_ok())
}

/// A word for a POSIX shell, quoted.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Starts the agents that do not answer yet; every host's outcome, or every failure at once.
pub fn launch(r: &Resolved, o: &LaunchOptions) -> Result<Vec<Launched>> {
    let mut done = Vec::new();
    let mut failed = Vec::new();
    for (host, e) in &r.topology.hosts {
        let agent = e.agent().to_string();
        if answers(&agent) {
            done.push(Launched {
                host: host.clone(),
                agent,
                pid: None,
            });
            continue;
        }
        match start_one(host, e, o) {
            Ok(pid) => done.push(Launched {
                host: host.clone(),
                agent,
                pid: Some(pid),
            }),
            Err(err) => failed.push(format!("host {host} ({agent}): {err:#}")),
        }
    }
    if !failed.is_empty() {
        bail!("{}", failed.join("\n"));
    }
    Ok(done)
}

fn start_one(host: &str, e: &tessera_config::HostEntry, o: &LaunchOptions) -> Result<u32> {
    let agent = e.agent();
    let mut remote = format!(
        // `;`, not `&&`: only the agent goes to the background (a background list would read
        // the token from /dev/null).
        "read -r TESSERA_TOKEN || exit 1; export TESSERA_TOKEN; setsid nohup {} node --listen {}",
        sh_quote(&o.binary),
        sh_quote(agent)
    );
    if let Some(out) = &o.output {
        remote += &format!(" --output {}", sh_quote(out));
    }
    if let Some((cert, key)) = &o.tls {
        remote += &format!(
            " --tls-certificate {} --tls-key {}",
            sh_quote(&cert.replace("{host}", host)),
            sh_quote(&key.replace("{host}", host))
        );
    }
    remote += &format!(" >{} 2>&1 </dev/null & echo $!", sh_quote(&o.log));
    let mut words = o.ssh.split_whitespace();
    let program = words.next().context("--ssh is empty")?;
    let mut child = Command::new(program)
        .args(words)
        .arg(e.ssh_destination())
        .arg(remote)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {program}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        writeln!(stdin, "{}", o.token).context("handing over the token")?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "ssh {} failed ({}): {}",
            e.ssh_destination(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let pid: u32 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .lines()
        .last()
        .and_then(|l| l.trim().parse().ok())
        .context("the remote shell did not say the agent's process ID")?;
    let t = Instant::now();
    while !answers(agent) {
        if t.elapsed() > o.patience {
            bail!(
                "started (pid {pid}) but not answering at {agent} after {} s: see {} on {host}",
                o.patience.as_secs(),
                o.log
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(pid)
}

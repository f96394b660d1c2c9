//! A remote host over OpenSSH, as sites copy to their storage front ends: `ssh://[user@]host
//! [:port]/path`. The site's own `ssh` runs every transfer, so its keys, `~/.ssh/config`,
//! known hosts, jump hosts and agent apply unchanged; `TESSERA_SSH` replaces the command (as
//! `GIT_SSH_COMMAND` does for git: `TESSERA_SSH="ssh -F /etc/tessera/ssh_config"`). It never
//! asks for a password (`BatchMode=yes`): a service has nobody to answer.
//!
//! The far side needs only a POSIX shell and coreutils (`cat`, `wc`, `sync`, `mv`), which every
//! login on a storage host has. A copy streams into `<file>.part`, which is renamed to its
//! final name only once it holds exactly the bytes that were sent (a copy cut short by a
//! dropped connection would otherwise end `cat` as cleanly as a whole one) and has been synced.
//! The read-back for verification is a full `cat` of the final file, checksummed here.

use std::io::{self, Read, Write};
use std::process::{Child, Command, Stdio};

use crate::Destination;

#[derive(Clone, Debug, PartialEq)]
pub struct SshTarget {
    /// `user@host` or `host`, as given to `ssh`.
    pub host: String,
    pub port: Option<u16>,
    /// The directory at the far side.
    pub path: String,
    /// The ssh command and its options (`TESSERA_SSH`, split on spaces; `ssh` by default).
    pub command: Vec<String>,
}

impl SshTarget {
    /// Parses `ssh://[user@]host[:port]/path`; the command from `TESSERA_SSH`.
    pub fn from_url_and_env(url: &str) -> Result<SshTarget, String> {
        let rest = url
            .strip_prefix("ssh://")
            .ok_or_else(|| format!("{url}: not an ssh://[user@]host[:port]/path address"))?;
        let (authority, path) = rest
            .split_once('/')
            .ok_or_else(|| format!("{url}: no path (ssh://host/path/to/archive)"))?;
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => (
                h,
                Some(
                    p.parse::<u16>()
                        .map_err(|_| format!("{url}: port {p:?} is not a number"))?,
                ),
            ),
            _ => (authority, None),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || host.rsplit('@').next().is_none_or(str::is_empty) {
            return Err(format!("{url}: no host"));
        }
        if host.starts_with('-') {
            return Err(format!("{url}: a host cannot start with '-'"));
        }
        let command: Vec<String> = std::env::var("TESSERA_SSH")
            .ok()
            .filter(|c| !c.trim().is_empty())
            .unwrap_or_else(|| "ssh".into())
            .split_whitespace()
            .map(String::from)
            .collect();
        Ok(SshTarget {
            host: host.into(),
            port,
            path: format!("/{}", path.trim_end_matches('/')),
            command,
        })
    }
}

pub struct SshDestination {
    target: SshTarget,
}

impl SshDestination {
    pub fn new(target: SshTarget) -> SshDestination {
        SshDestination { target }
    }

    /// `ssh … host sh -c SCRIPT sh ARGS…`: the script and its arguments quoted for the remote
    /// login shell, whatever it is (every shell takes single quotes alike).
    fn command(&self, script: &str, args: &[&str]) -> Command {
        let t = &self.target;
        let mut c = Command::new(&t.command[0]);
        // Bounds on a host that does not answer and on a connection that dies mid-copy; the
        // site's own values in TESSERA_SSH come first, and ssh takes the first it is given.
        c.args(&t.command[1..]).args([
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=15",
            "-o",
            "ServerAliveInterval=15",
            "-o",
            "ServerAliveCountMax=4",
        ]);
        if let Some(p) = t.port {
            c.arg("-p").arg(p.to_string());
        }
        let mut remote = format!("sh -c {} sh", quote(script));
        for a in args {
            remote.push(' ');
            remote.push_str(&quote(a));
        }
        c.arg("--").arg(&t.host).arg(remote);
        c
    }
}

/// Single-quoted for a POSIX shell.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The child's exit: `Ok(true)` for success, `Ok(false)` for the exit code `absent` (the
/// script's "no such file"), else an error with what it said on stderr.
fn finish(mut child: Child, what: &str, absent: Option<i32>) -> io::Result<bool> {
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    let status = child.wait()?;
    if status.success() {
        return Ok(true);
    }
    if absent.is_some() && status.code() == absent {
        return Ok(false);
    }
    let err = err.trim();
    Err(io::Error::other(match status.code() {
        Some(255) => format!("{what}: ssh could not reach the host: {err}"),
        _ => format!("{what}: {status}: {err}"),
    }))
}

/// Streams stdin into `$1/$2.part`; renames it to `$1/$2` once it holds `$3` bytes and is on
/// disk. A short copy is removed and named.
const PUT: &str = r#"set -e
umask 022
mkdir -p "$1"
cat > "$1/$2.part"
n=$(wc -c < "$1/$2.part")
if [ "$n" -ne "$3" ]; then rm -f "$1/$2.part"; echo "copy cut short: $n of $3 bytes arrived" >&2; exit 3; fi
sync "$1/$2.part" 2>/dev/null || sync
mv -f "$1/$2.part" "$1/$2"
sync "$1" 2>/dev/null || true"#;

/// The exit code of [`GET`] when there is no such file.
const ABSENT: i32 = 44;

/// The final file to stdout; exit [`ABSENT`] if there is none.
const GET: &str = r#"[ -e "$1/$2" ] || exit 44
exec cat "$1/$2""#;

impl Destination for SshDestination {
    fn name(&self) -> String {
        let t = &self.target;
        let host = if t.host.contains(':') {
            format!("[{}]", t.host)
        } else {
            t.host.clone()
        };
        match t.port {
            Some(p) => format!("ssh://{host}:{p}{}", t.path),
            None => format!("ssh://{host}{}", t.path),
        }
    }

    fn put(&self, file: &str, size: u64, read: &mut dyn Read) -> io::Result<()> {
        let mut chunk = vec![0u8; 1 << 20];
        let mut child = self
            .command(PUT, &[&self.target.path, file, &size.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| io::Error::other(format!("{}: {e}", self.target.command[0])))?;
        let mut stdin = child.stdin.take().expect("piped");
        let sent = (|| -> io::Result<()> {
            loop {
                let k = read.read(&mut chunk)?;
                if k == 0 {
                    return Ok(());
                }
                stdin.write_all(&chunk[..k])?;
            }
        })();
        if let Err(e) = sent {
            // Never close the stream as if it were whole: the far side's byte count would
            // catch a short copy, and killing ssh makes doubly sure nothing is renamed. A
            // broken pipe means ssh ended first: what it said is the reason.
            drop(stdin);
            if e.kind() != io::ErrorKind::BrokenPipe {
                let _ = child.kill();
            }
            return Err(match finish(child, "copy", None) {
                Err(why) => why,
                Ok(_) => e,
            });
        }
        drop(stdin);
        finish(child, "copy", None).map(|_| ())
    }

    fn check(&self, file: &str) -> io::Result<Option<crate::Digest>> {
        let mut child = self
            .command(GET, &[&self.target.path, file])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| io::Error::other(format!("{}: {e}", self.target.command[0])))?;
        let got = crate::digest_of(child.stdout.take().expect("piped"));
        match finish(child, "read-back", Some(ABSENT))? {
            true => got.map(Some),
            false => Ok(None),
        }
    }
}

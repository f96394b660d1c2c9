//! Hosts as network namespaces made by the test (root, iproute2): a DAQ host with two front-end
//! networks, one allowed by `security.allow` and one not. Without root or `ip netns` the tests
//! say SKIPPED and pass; CI runs as root.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use support::{ip, on_host, Proc, LIMIT};
use tessera_format::wire::{encode_fragment, FragmentHeader, Hello, StreamEnd};

/// Namespaces and links made for one test, removed when it ends.
struct Hosts {
    names: Vec<String>,
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

/// `daq`, joined by a veth pair to each front-end host `ok` (10.77.1.0/24) and `bad`
/// (10.77.2.0/24); the DAQ host is .1 on both. `None` where namespaces cannot be made.
fn make_hosts() -> Option<(Hosts, [String; 3])> {
    let tag = format!("t{}", std::process::id() % 100_000);
    let [daq, ok, bad] = ["daq", "ok", "bad"].map(|h| format!("{tag}{h}"));
    let mut hosts = Hosts { names: Vec::new() };
    for n in [&daq, &ok, &bad] {
        if !ip(&["netns", "add", n]) {
            return None;
        }
        hosts.names.push(n.clone());
        ip(&["-n", n, "link", "set", "lo", "up"]).then_some(())?;
    }
    for (peer, net, a, b) in [(&ok, "10.77.1", "a", "b"), (&bad, "10.77.2", "c", "d")] {
        let (x, y) = (format!("{tag}{a}"), format!("{tag}{b}"));
        let steps: [&[&str]; 8] = [
            &["link", "add", &x, "type", "veth", "peer", "name", &y],
            &["link", "set", &x, "netns", &daq],
            &["link", "set", &y, "netns", peer],
            &["-n", &daq, "addr", "add", &format!("{net}.1/24"), "dev", &x],
            &["-n", peer, "addr", "add", &format!("{net}.2/24"), "dev", &y],
            &["-n", &daq, "link", "set", &x, "up"],
            &["-n", peer, "link", "set", &y, "up"],
            &["-n", &daq, "link", "show", &x],
        ];
        for s in steps {
            ip(s).then_some(())?;
        }
    }
    Some((hosts, [daq, ok, bad]))
}

/// Connects, retrying while the readout unit is not listening yet.
fn connect(addr: &str) -> TcpStream {
    let t = Instant::now();
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => return s,
            Err(e) if t.elapsed() > Duration::from_secs(60) => panic!("{addr}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// A source's whole stream, written from the spec's encoders: hello, `events` fragments, end.
fn stream(source: u32, events: u64) -> Vec<u8> {
    let mut b = Hello::new(source).encode().to_vec();
    for ev in 0..events {
        let h = FragmentHeader {
            source_id: source,
            event_id: ev,
            trigger_type: 1,
            payload_size: 64,
            ..Default::default()
        };
        encode_fragment(&mut b, &h, &[ev as u8; 64]);
    }
    b.extend_from_slice(
        &StreamEnd {
            source_id: source,
            fragments_sent: events,
        }
        .encode(),
    );
    b
}

/// Issue 11, item 11: a readout unit listening beyond loopback takes a source's connection only
/// from the networks in `security.allow`. A host on another network that forges source 9 is
/// refused, counted and logged with its address, and none of its bytes reach the run; the real
/// source 9 on the allowed network then delivers every event.
#[test]
fn a_forged_source_from_outside_the_allowed_networks_is_refused() {
    let Some((_hosts, [daq, ok, bad])) = make_hosts() else {
        println!("SKIPPED: network namespaces need root and iproute2");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let events = 500u64;
    let cfg = dir.path().join("hosts.toml");
    std::fs::write(
        &cfg,
        format!(
            "[run]\nevents = {events}\noutput = \"{}\"\n\
             [sources]\ncount = 2\nexternal = [9]\ntrigger_types = 1\nfragment_size = 256\n\
             [[readout]]\nid = 0\nsources = \"0-1\"\n\
             [[readout]]\nid = 1\nsources = [9]\nlisten = \"0.0.0.0:7000\"\n\
             [[builder]]\nid = 0\n\
             [security]\nallow = [\"10.77.1.0/24\"]\n",
            out.display()
        ),
    )
    .unwrap();
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &daq, env!("CARGO_BIN_EXE_tessera"), "run"])
        .arg(&cfg)
        .args(["--json", "--quiet"])
        .env("TESSERA_HTTP", "127.0.0.1:0");
    let run = Proc::spawn_piped(&mut cmd);
    // The forger: refused at once, before its hello is read.
    let forged = on_host(&bad, || {
        let mut s = connect("10.77.2.1:7000");
        let _ = s.write_all(&stream(9, 10));
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut b = [0u8; 16];
        matches!(s.read(&mut b), Ok(0) | Err(_))
    });
    assert!(forged, "the forged source's connection stayed open");
    on_host(&ok, move || {
        let mut s = connect("10.77.1.1:7000");
        s.write_all(&stream(9, events)).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let _ = s.read(&mut [0u8; 8]);
    });
    let o = run.finish(LIMIT);
    let stderr = String::from_utf8_lossy(&o.stderr);
    let r: serde_json::Value =
        serde_json::from_slice(&o.stdout).unwrap_or_else(|_| panic!("no report; stderr: {stderr}"));
    assert_eq!(r["events_complete"], events, "{r}\n{stderr}");
    assert_eq!(r["events_incomplete"], 0, "{r}");
    assert_eq!(r["refused_outside_allow"], 1, "{r}");
    assert!(
        stderr.contains("10.77.2.2"),
        "the refusal names the peer: {stderr}"
    );
    let s9 = r["sources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == 9)
        .unwrap();
    assert_eq!(
        (&s9["sent"], &s9["received"]),
        (&events.into(), &events.into()),
        "{s9}"
    );
}

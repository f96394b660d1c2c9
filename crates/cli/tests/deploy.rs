//! The systemd units shipped in deploy/systemd pass `systemd-analyze verify` with no complaint
//! (skipped, saying so, where systemd-analyze is not installed), with the binary under test in
//! place of /usr/bin/tessera. The Kubernetes manifest's agent command starts an agent that
//! answers on its ports (its schema is checked by `kubernetes-validate` in scripts/test).

mod support;
use std::io::{Read, Write};
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use support::{eventually, ip, on_host, Proc};

/// The DaemonSet's container command, run as written (its binary and data directory
/// replaced by the ones under test) in a network namespace of its own, as `hostNetwork`
/// would on a node: the agent answers on the agent port and serves /metrics.
#[test]
fn the_kubernetes_agent_command_starts_an_agent_serving_its_ports() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/k8s/tessera-node.yaml");
    let text = std::fs::read_to_string(src).unwrap();
    let line = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("command:"))
        .expect("a command in the manifest");
    let command: Vec<String> = serde_json::from_str(line.trim()).unwrap();
    assert_eq!(command[0], "/usr/bin/tessera", "{command:?}");
    let ns = format!("k8s{}", std::process::id());
    if !ip(&["netns", "add", &ns]) {
        println!("SKIPPED: network namespaces need root and iproute2");
        return;
    }
    struct Gone(String);
    impl Drop for Gone {
        fn drop(&mut self) {
            ip(&["netns", "del", &self.0]);
        }
    }
    let _gone = Gone(ns.clone());
    assert!(ip(&["-n", &ns, "link", "set", "lo", "up"]));
    let dir = tempfile::tempdir().unwrap();
    let args: Vec<String> = command[1..]
        .iter()
        .map(|a| match a.as_str() {
            "/data" => dir.path().to_str().unwrap().to_string(),
            _ => a.clone(),
        })
        .collect();
    let agent = Proc::spawn(
        Command::new("ip")
            .args(["netns", "exec", &ns, env!("CARGO_BIN_EXE_tessera")])
            .args(&args)
            .env("TESSERA_TOKEN", "k8s-test-token")
            .env("TESSERA_LOG_FORMAT", "json"),
    );
    let metrics = || {
        on_host(&ns, || {
            let mut s = std::net::TcpStream::connect("127.0.0.1:9300").ok()?;
            s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .ok()?;
            let mut r = String::new();
            s.read_to_string(&mut r).ok()?;
            Some(r)
        })
    };
    let mut got = None;
    assert!(
        eventually(Duration::from_secs(60), || {
            got = metrics();
            got.as_deref()
                .is_some_and(|r| r.contains("tessera_node_up"))
        }),
        "no /metrics on 9300: {got:?}"
    );
    assert!(
        on_host(&ns, || std::net::TcpStream::connect("127.0.0.1:7300")
            .is_ok()),
        "nothing on the agent port 7300"
    );
    agent.signal("INT");
    assert!(agent.finish(Duration::from_secs(60)).status.success());
}

#[test]
fn the_systemd_units_verify_cleanly() {
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("SKIPPED: systemd-analyze is not installed");
        return;
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/systemd");
    let dir = tempfile::tempdir().unwrap();
    let env_file = dir.path().join("run.env");
    let node_env = dir.path().join("node.env");
    let ship_env = dir.path().join("ship.env");
    let mut units = Vec::new();
    for f in std::fs::read_dir(&src).unwrap().flatten() {
        let name = f.file_name().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(f.path()).unwrap();
        let text = text
            .replace("/usr/bin/tessera", env!("CARGO_BIN_EXE_tessera"))
            .replace("/etc/tessera/run.env", env_file.to_str().unwrap())
            .replace("/etc/tessera/node.env", node_env.to_str().unwrap())
            .replace("/etc/tessera/ship.env", ship_env.to_str().unwrap());
        std::fs::write(dir.path().join(&name), text).unwrap();
        if name.ends_with(".service") || name.ends_with(".socket") {
            // Templates are verified through an instance.
            units.push(name.replace("@.", "@0."));
        }
    }
    units.sort();
    assert!(units.len() >= 6, "{units:?}");
    assert!(
        units.iter().any(|u| u == "tessera-node.service"),
        "{units:?}"
    );
    let o = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .args(&units)
        .current_dir(dir.path())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && said.trim().is_empty(),
        "{units:?}: {}\n{said}",
        o.status
    );
}

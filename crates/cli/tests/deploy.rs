//! The systemd units shipped in deploy/systemd pass `systemd-analyze verify` with no complaint
//! (skipped, saying so, where systemd-analyze is not installed), with the binary under test in
//! place of /usr/bin/tessera.

use std::path::Path;
use std::process::Command;

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
    let mut units = Vec::new();
    for f in std::fs::read_dir(&src).unwrap().flatten() {
        let name = f.file_name().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(f.path()).unwrap();
        let text = text
            .replace("/usr/bin/tessera", env!("CARGO_BIN_EXE_tessera"))
            .replace("/etc/tessera/run.env", env_file.to_str().unwrap())
            .replace("/etc/tessera/node.env", node_env.to_str().unwrap());
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

//! The dashboard's chart library (uPlot) comes from npm, pinned by `web/package-lock.json`. A
//! fresh clone has no `web/node_modules`: this installs it (`npm ci`) so that `cargo build`
//! alone builds everything, then hands the two files the binary embeds to the compiler.

use std::path::Path;
use std::process::Command;

fn main() {
    let web = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../web");
    let dist = web.join("node_modules/uplot/dist");
    println!(
        "cargo:rerun-if-changed={}",
        web.join("package-lock.json").display()
    );
    println!("cargo:rerun-if-changed={}", dist.display());
    let want = ["uPlot.iife.min.js", "uPlot.min.css"];
    if !want.iter().all(|f| dist.join(f).exists()) {
        let npm = if cfg!(windows) { "npm.cmd" } else { "npm" };
        let status = Command::new(npm)
            .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
            .current_dir(&web)
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!(
                "`npm ci` in {} failed ({s}): the dashboard's chart library comes from the npm registry",
                web.display()
            ),
            Err(e) => panic!(
                "cannot run npm ({e}): the dashboard's chart library comes from npm; install Node.js and npm, then build again"
            ),
        }
    }
    let out = std::env::var("OUT_DIR").expect("OUT_DIR");
    for f in want {
        std::fs::copy(dist.join(f), Path::new(&out).join(f))
            .unwrap_or_else(|e| panic!("copying {f} from {}: {e}", dist.display()));
    }
}

//! A real small file system for the disk drills: a tmpfs mounted by the test (it needs root, as
//! CI has; elsewhere the drill says so and does nothing).

use std::path::{Path, PathBuf};
use std::process::Command;

/// A tmpfs of `mib` MiB mounted at a new directory, unmounted when dropped.
pub struct SmallDisk {
    at: PathBuf,
    _dir: tempfile::TempDir,
}

impl SmallDisk {
    /// None without root (the caller says the drill was skipped).
    pub fn mount(mib: u64) -> Option<SmallDisk> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED: mounting a tmpfs needs root (CI runs this test)");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let at = dir.path().join("disk");
        std::fs::create_dir(&at).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(&at)
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(SmallDisk { at, _dir: dir })
    }

    pub fn path(&self) -> &Path {
        &self.at
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.at).status();
    }
}

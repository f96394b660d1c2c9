//! A directory destination: a mounted remote file system (NFS, EOS, CephFS), or a local disk.

use std::fs::File;
use std::io::{self, Read, Write};
use std::path::PathBuf;

use crate::Destination;

pub struct DirDestination {
    root: PathBuf,
}

impl DirDestination {
    pub fn new(root: impl Into<PathBuf>) -> DirDestination {
        DirDestination { root: root.into() }
    }
}

impl Destination for DirDestination {
    fn name(&self) -> String {
        self.root.display().to_string()
    }

    /// Written as `<file>.part`, synced, renamed, the directory synced: a reader of the
    /// destination never sees a partial file under the final name.
    /// A copy that fails (a full destination, a read error) leaves no `.part` behind: it would
    /// hold the destination's space until the next try.
    fn put(&self, file: &str, _size: u64, read: &mut dyn Read) -> io::Result<()> {
        std::fs::create_dir_all(&self.root)?;
        let part = self.root.join(format!("{file}.part"));
        let copied = (|| {
            let mut out = File::create(&part)?;
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = read.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                out.write_all(&buf[..n])?;
            }
            out.sync_all()?;
            drop(out);
            std::fs::rename(&part, self.root.join(file))
        })();
        if let Err(e) = copied {
            let _ = std::fs::remove_file(&part);
            return Err(e);
        }
        File::open(&self.root)?.sync_all()
    }

    fn check(&self, file: &str) -> io::Result<Option<crate::Digest>> {
        match File::open(self.root.join(file)) {
            Ok(f) => crate::digest_of(f).map(Some),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gives `n` bytes, then fails, as a disk that fills mid-copy does.
    struct FailsAfter(usize);

    impl Read for FailsAfter {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.0 == 0 {
                return Err(io::Error::other("No space left on device"));
            }
            let n = self.0.min(buf.len());
            buf[..n].fill(7);
            self.0 -= n;
            Ok(n)
        }
    }

    /// Issue 50, item 8: a copy that fails leaves no `.part` at the destination.
    #[test]
    fn a_failed_copy_leaves_no_part_behind() {
        let t = tempfile::tempdir().unwrap();
        let d = DirDestination::new(t.path().join("archive"));
        assert!(d
            .put("run000001_0001.tsr", 0, &mut FailsAfter(3 << 20))
            .is_err());
        let left: Vec<_> = std::fs::read_dir(t.path().join("archive"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(left.is_empty(), "{left:?}");
        assert!(d.put("run000001_0001.tsr", 0, &mut &b"whole"[..]).is_ok());
        assert_eq!(d.check("run000001_0001.tsr").unwrap().unwrap().size, 5);
    }
}

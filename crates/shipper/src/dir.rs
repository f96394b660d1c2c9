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
    fn put(&self, file: &str, _size: u64, read: &mut dyn Read) -> io::Result<()> {
        std::fs::create_dir_all(&self.root)?;
        let part = self.root.join(format!("{file}.part"));
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
        std::fs::rename(&part, self.root.join(file))?;
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

//! The facts every planarian crate reads from the host, each read in one place:
//!
//! * [`proc`]: `/proc`, through a handle for a process or a thread ([`proc::Proc`]: its maps,
//!   status, stat, descriptors, links, command line, mounts (escaped mount points unescaped),
//!   and its page map), every read naming its file in its error;
//! * [`write_atomic`]: a file replaced whole (temporary file, fsync, rename, directory fsync), so
//!   that a reader, or a crash, never sees half of it;
//! * [`IoError`]: an I/O failure that names what was done to which file, the one line a user
//!   reads.
//!
//! No dependencies beyond the standard library and `thiserror`: the runtime binary that Podman
//! executes for every verb, CRIU's action script and the MCP proxy all link it.

pub mod proc;

use std::io::Write;
use std::path::{Path, PathBuf};

/// An I/O operation on a path that failed: `cannot read /x/y: No such file or directory`.
#[derive(Debug, thiserror::Error)]
#[error("cannot {action} {}: {source}", path.display())]
pub struct IoError {
    pub action: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

impl IoError {
    pub fn new(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> IoError {
        IoError { action, path: path.into(), source }
    }

    pub fn kind(&self) -> std::io::ErrorKind {
        self.source.kind()
    }
}

/// `.at("read", &path)` on an `io::Result`: the error names the action and the path.
pub trait Context<T> {
    fn at(self, action: &'static str, path: impl AsRef<Path>) -> Result<T, IoError>;
}

impl<T> Context<T> for std::io::Result<T> {
    fn at(self, action: &'static str, path: impl AsRef<Path>) -> Result<T, IoError> {
        self.map_err(|e| IoError::new(action, path.as_ref(), e))
    }
}

/// Replaces `path` with `data` (mode `mode`) through a temporary file in the same directory, an
/// fsync, a rename and an fsync of the directory: readers see the old file or the new one, and
/// after a crash the rename is either there with all its data or not at all. Creates the
/// directory when missing.
pub fn write_atomic(path: &Path, data: &[u8], mode: u32) -> Result<(), IoError> {
    use std::os::unix::fs::PermissionsExt;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir).at("create", dir)?;
    let tmp = dir.join(format!(".{}.tmp", path.file_name().unwrap_or_default().to_string_lossy()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(data)?;
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    result.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        IoError::new("write", path, e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_whole_and_names_the_file_on_failure() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join("sys");
        let f = dir.join("a/b.json");
        write_atomic(&f, b"one", 0o600).unwrap();
        write_atomic(&f, b"two", 0o644).unwrap();
        assert_eq!(std::fs::read_to_string(&f).unwrap(), "two");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&f).unwrap().permissions().mode() & 0o777, 0o644);
        assert_eq!(std::fs::read_dir(dir.join("a")).unwrap().count(), 1, "no temporary file left");
        std::fs::create_dir_all(dir.join("a/dir")).unwrap();
        let e = write_atomic(&dir.join("a/dir"), b"x", 0o644).unwrap_err();
        assert!(e.to_string().starts_with(&format!("cannot write {}", dir.join("a/dir").display())), "{e}");
    }

    #[test]
    fn context_names_action_and_path() {
        let e = std::fs::read("/nonexistent/planarian").at("read", "/nonexistent/planarian").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound);
        assert!(e.to_string().starts_with("cannot read /nonexistent/planarian: "), "{e}");
    }
}

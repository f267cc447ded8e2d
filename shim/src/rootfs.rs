//! The files part of a statepoint.
//!
//! [`Rootfs`] is the interface; [`CopyRootfs`] is the path that works on every host: a full copy
//! of the container's writable layer (the overlay upper directory, with its whiteouts and opaque
//! directories, so deletions of image files are captured too), taken while the container is
//! frozen. A ZFS implementation snapshots and clones datasets instead.

use std::path::{Path, PathBuf};
use std::process::Command;

pub trait Rootfs {
    /// The name recorded in the manifest ("copy", "zfs").
    fn backend(&self) -> &'static str;
    /// Captures the files into `dest` (inside the statepoint directory). Container frozen.
    fn snapshot(&self, dest: &Path) -> Result<(), String>;
    /// Makes the files exactly what `saved` holds. The container's rootfs is not mounted.
    /// Returns a guard that, unless committed, puts the previous files back.
    fn restore(&self, saved: &Path) -> Result<RestoreGuard, String>;
}

pub struct CopyRootfs {
    pub upperdir: PathBuf,
}

fn cp() -> Result<PathBuf, String> {
    crate::tools::locate("cp", None, "PATH").map_err(|e| e.to_string())
}

fn copy_tree(from: &Path, to: &Path) -> Result<(), String> {
    // GNU cp -a keeps owners, modes, times, xattrs (trusted.overlay.opaque), hard links,
    // symlinks, and device nodes (overlay whiteouts are 0:0 character devices).
    let out = Command::new(cp()?)
        .args(["-a", "--reflink=auto", "--no-target-directory"])
        .arg(from)
        .arg(to)
        .output()
        .map_err(|e| format!("cannot run cp: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        let _ = std::fs::remove_dir_all(to);
        Err(format!(
            "copying {} failed: {}",
            from.display(),
            String::from_utf8_lossy(&out.stderr).lines().next().unwrap_or("").trim()
        ))
    }
}

impl Rootfs for CopyRootfs {
    fn backend(&self) -> &'static str {
        "copy"
    }

    fn snapshot(&self, dest: &Path) -> Result<(), String> {
        copy_tree(&self.upperdir, dest)
    }

    fn restore(&self, saved: &Path) -> Result<RestoreGuard, String> {
        if crate::container::upperdir_mounted(&self.upperdir) {
            return Err(format!("the container's files are still mounted ({}); stop it first", self.upperdir.display()));
        }
        let name = self.upperdir.file_name().unwrap_or_default().to_string_lossy().into_owned();
        let parent = self.upperdir.parent().ok_or("upper directory has no parent")?;
        let fresh = parent.join(format!("{name}.planarian-new"));
        let old = parent.join(format!("{name}.planarian-old"));
        let _ = std::fs::remove_dir_all(&fresh);
        copy_tree(saved, &fresh)?;
        // A leftover from a crash: the current upper dir is the truth, drop the old copy.
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(&self.upperdir, &old).map_err(|e| format!("cannot move {} aside: {e}", self.upperdir.display()))?;
        if let Err(e) = std::fs::rename(&fresh, &self.upperdir) {
            let _ = std::fs::rename(&old, &self.upperdir);
            return Err(format!("cannot put the statepoint's files in place: {e}"));
        }
        Ok(RestoreGuard { current: self.upperdir.clone(), previous: Some(old) })
    }
}

/// Keeps the files as they were before a restore until [`RestoreGuard::commit`]; dropping it
/// uncommitted puts them back.
pub struct RestoreGuard {
    current: PathBuf,
    previous: Option<PathBuf>,
}

impl RestoreGuard {
    pub fn commit(mut self) {
        if let Some(old) = self.previous.take() {
            let _ = std::fs::remove_dir_all(old);
        }
    }

    /// Puts the previous files back now.
    pub fn undo(mut self) -> Result<(), String> {
        self.undo_inner()
    }

    fn undo_inner(&mut self) -> Result<(), String> {
        let Some(old) = self.previous.take() else { return Ok(()) };
        let _ = std::fs::remove_dir_all(&self.current);
        std::fs::rename(&old, &self.current).map_err(|e| format!("cannot put the previous files back: {e}"))
    }
}

impl Drop for RestoreGuard {
    fn drop(&mut self) {
        let _ = self.undo_inner();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_snapshot_and_restore_are_exact_and_undoable() {
        let base = std::env::temp_dir().join(format!("planarian-rootfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let upper = base.join("diff");
        std::fs::create_dir_all(upper.join("etc")).unwrap();
        std::fs::write(upper.join("etc/app.conf"), "v1").unwrap();
        std::os::unix::fs::symlink("app.conf", upper.join("etc/link")).unwrap();
        let r = CopyRootfs { upperdir: upper.clone() };
        r.snapshot(&base.join("sp1")).unwrap();

        std::fs::write(upper.join("etc/app.conf"), "v2").unwrap();
        std::fs::write(upper.join("new-file"), "x").unwrap();
        let guard = r.restore(&base.join("sp1")).unwrap();
        assert_eq!(std::fs::read_to_string(upper.join("etc/app.conf")).unwrap(), "v1");
        assert!(!upper.join("new-file").exists());
        assert_eq!(std::fs::read_link(upper.join("etc/link")).unwrap(), Path::new("app.conf"));
        guard.undo().unwrap();
        assert_eq!(std::fs::read_to_string(upper.join("etc/app.conf")).unwrap(), "v2");
        assert!(upper.join("new-file").exists());

        let guard = r.restore(&base.join("sp1")).unwrap();
        guard.commit();
        assert!(!base.join("diff.planarian-old").exists());
        assert_eq!(std::fs::read_to_string(upper.join("etc/app.conf")).unwrap(), "v1");
        std::fs::remove_dir_all(&base).unwrap();
    }
}

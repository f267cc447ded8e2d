//! The files part of a statepoint.
//!
//! [`Rootfs`] is the interface; [`CopyRootfs`] is the path that works on every host: a full copy
//! of the container's writable layer (the overlay upper directory, with its whiteouts and opaque
//! directories, so deletions of image files are captured too), taken while the container is
//! frozen. [`crate::zfs_rootfs::ZfsRootfs`] snapshots and clones ZFS datasets instead.

use std::path::{Path, PathBuf};
use std::process::Command;
use crate::store::LocalState;

pub trait Rootfs: Send + Sync {
    /// The name recorded in the manifest ("copy", "zfs").
    fn backend(&self) -> &'static str;
    /// Where statepoint `sp` (directory `sp_dir`) will keep its files: the manifest's fields,
    /// written before the snapshot so a crash half-way can be cleaned up.
    fn plan(&self, sp: &str, local: &mut LocalState);
    /// Captures the files as `local` says. Container frozen.
    fn snapshot(&self, sp_dir: &Path, local: &LocalState) -> Result<(), String>;
    /// Drops what [`Rootfs::snapshot`] captured, for a statepoint that is not committed.
    fn discard(&self, sp_dir: &Path, local: &LocalState);
    /// Makes the files exactly what statepoint `local` (in `sp_dir`) holds. The container does
    /// not run. Returns a guard that, unless committed, puts the previous files back.
    fn restore(&self, sp_dir: &Path, local: &LocalState) -> Result<RestoreGuard, String>;
}

/// The files path of a container: its ZFS dataset when it has one, else a copy of its overlay
/// writable layer.
pub fn for_container(cfg: &crate::config::Config, store: &crate::store::ContainerStore, id: &str, upperdir: Option<PathBuf>) -> Result<Box<dyn Rootfs>, String> {
    if let Some(z) = crate::zfs_rootfs::ZfsRootfs::for_container(cfg, store, id)? {
        return Ok(Box::new(z));
    }
    let upperdir = upperdir.ok_or_else(|| format!("container {id}'s rootfs is neither a ZFS dataset nor an overlay: planarian cannot keep its files"))?;
    Ok(Box::new(CopyRootfs { upperdir }))
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

    fn plan(&self, _sp: &str, local: &mut LocalState) {
        local.rootfs_backend = self.backend().into();
        local.rootfs_copy_path = Some("rootfs".into());
        local.rootfs_upperdir = Some(self.upperdir.display().to_string());
        local.zfs_snapshot = None;
    }

    fn snapshot(&self, sp_dir: &Path, local: &LocalState) -> Result<(), String> {
        copy_tree(&self.upperdir, &sp_dir.join(local.rootfs_copy_path.as_deref().unwrap_or("rootfs")))
    }

    fn discard(&self, sp_dir: &Path, local: &LocalState) {
        let _ = std::fs::remove_dir_all(sp_dir.join(local.rootfs_copy_path.as_deref().unwrap_or("rootfs")));
    }

    fn restore(&self, sp_dir: &Path, local: &LocalState) -> Result<RestoreGuard, String> {
        let saved = sp_dir.join(local.rootfs_copy_path.as_deref().unwrap_or("rootfs"));
        if !saved.exists() {
            return Err(format!("the statepoint's files are missing from {}", saved.display()));
        }
        if crate::container::upperdir_mounted(&self.upperdir) {
            return Err(format!("the container's files are still mounted ({}); stop it first", self.upperdir.display()));
        }
        let name = self.upperdir.file_name().unwrap_or_default().to_string_lossy().into_owned();
        let parent = self.upperdir.parent().ok_or("upper directory has no parent")?;
        let fresh = parent.join(format!("{name}.planarian-new"));
        let old = parent.join(format!("{name}.planarian-old"));
        let _ = std::fs::remove_dir_all(&fresh);
        copy_tree(&saved, &fresh)?;
        // A leftover from a crash: the current upper dir is the truth, drop the old copy.
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(&self.upperdir, &old).map_err(|e| format!("cannot move {} aside: {e}", self.upperdir.display()))?;
        if let Err(e) = std::fs::rename(&fresh, &self.upperdir) {
            let _ = std::fs::rename(&old, &self.upperdir);
            return Err(format!("cannot put the statepoint's files in place: {e}"));
        }
        let current = self.upperdir.clone();
        let previous = old.clone();
        Ok(RestoreGuard::new(
            Box::new(move || {
                let _ = std::fs::remove_dir_all(&current);
                std::fs::rename(&previous, &current).map_err(|e| format!("cannot put the previous files back: {e}"))
            }),
            Box::new(move || {
                let _ = std::fs::remove_dir_all(old);
            }),
        ))
    }
}

/// Keeps the files as they were before a restore until [`RestoreGuard::commit`]; dropping it
/// uncommitted puts them back.
pub struct RestoreGuard {
    undo: Option<Box<dyn FnOnce() -> Result<(), String>>>,
    commit: Option<Box<dyn FnOnce()>>,
}

impl RestoreGuard {
    pub fn new(undo: Box<dyn FnOnce() -> Result<(), String>>, commit: Box<dyn FnOnce()>) -> RestoreGuard {
        RestoreGuard { undo: Some(undo), commit: Some(commit) }
    }

    pub fn commit(mut self) {
        self.undo = None;
        if let Some(c) = self.commit.take() {
            c();
        }
    }

    /// Puts the previous files back now.
    pub fn undo(mut self) -> Result<(), String> {
        self.undo_inner()
    }

    fn undo_inner(&mut self) -> Result<(), String> {
        self.commit = None;
        match self.undo.take() {
            Some(u) => u(),
            None => Ok(()),
        }
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
        let mut local = LocalState::default();
        r.plan("sp1", &mut local);
        let sp1 = base.join("sp1");
        std::fs::create_dir_all(&sp1).unwrap();
        r.snapshot(&sp1, &local).unwrap();

        std::fs::write(upper.join("etc/app.conf"), "v2").unwrap();
        std::fs::write(upper.join("new-file"), "x").unwrap();
        let guard = r.restore(&sp1, &local).unwrap();
        assert_eq!(std::fs::read_to_string(upper.join("etc/app.conf")).unwrap(), "v1");
        assert!(!upper.join("new-file").exists());
        assert_eq!(std::fs::read_link(upper.join("etc/link")).unwrap(), Path::new("app.conf"));
        guard.undo().unwrap();
        assert_eq!(std::fs::read_to_string(upper.join("etc/app.conf")).unwrap(), "v2");
        assert!(upper.join("new-file").exists());

        let guard = r.restore(&sp1, &local).unwrap();
        guard.commit();
        assert!(!base.join("diff.planarian-old").exists());
        assert_eq!(std::fs::read_to_string(upper.join("etc/app.conf")).unwrap(), "v1");
        std::fs::remove_dir_all(&base).unwrap();
    }
}

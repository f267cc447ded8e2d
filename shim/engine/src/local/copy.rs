//! The files path that works on every host: a full copy of the container's writable layer (the
//! overlay upper directory, with its whiteouts and opaque directories, so deletions of image
//! files are captured too), taken while the container is frozen.

use super::files::{InPlaceAt, InPlaceFiles, RestoreGuard, Rootfs};
use super::{Error, Result};
use crate::store::LocalState;
use std::path::{Path, PathBuf};
use std::process::Command;

pub struct CopyRootfs {
    pub upperdir: PathBuf,
}

/// `cp -a` with `extra` options from `from` to `to` (`--no-target-directory`); the error quotes
/// cp's first line. The one way planarian copies a tree (statepoint files, overlay layers, forks).
pub fn cp(extra: &[&str], from: &Path, to: &Path) -> Result<()> {
    let bin = crate::tools::locate("cp", None, "PATH")?;
    let out = Command::new(&bin)
        .arg("-a")
        .args(extra)
        .arg("--no-target-directory")
        .arg(from)
        .arg(to)
        .output()
        .map_err(|source| Error::Run { tool: bin, source })?;
    if out.status.success() {
        return Ok(());
    }
    Err(Error::Copy {
        from: from.to_path_buf(),
        why: String::from_utf8_lossy(&out.stderr).lines().next().unwrap_or("").trim().to_string(),
    })
}

fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    // GNU cp -a keeps owners, modes, times, xattrs (trusted.overlay.opaque), hard links,
    // symlinks, and device nodes (overlay whiteouts are 0:0 character devices).
    cp(&["--reflink=auto"], from, to).inspect_err(|_| {
        let _ = std::fs::remove_dir_all(to);
    })
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

    fn snapshot(&self, sp_dir: &Path, local: &LocalState) -> Result<()> {
        copy_tree(&self.upperdir, &sp_dir.join(local.rootfs_copy_path.as_deref().unwrap_or("rootfs")))
    }

    fn discard(&self, sp_dir: &Path, local: &LocalState) {
        let _ = std::fs::remove_dir_all(sp_dir.join(local.rootfs_copy_path.as_deref().unwrap_or("rootfs")));
    }

    fn restore(&self, sp_dir: &Path, local: &LocalState) -> Result<RestoreGuard> {
        let saved = sp_dir.join(local.rootfs_copy_path.as_deref().unwrap_or("rootfs"));
        if !saved.exists() {
            return Err(Error::FilesMissing(saved));
        }
        if crate::runtime::container::upperdir_mounted(&self.upperdir) {
            return Err(Error::FilesMounted(self.upperdir.clone()));
        }
        let name = self.upperdir.file_name().unwrap_or_default().to_string_lossy().into_owned();
        let parent = self.upperdir.parent().unwrap_or(Path::new("/"));
        let fresh = parent.join(format!("{name}.planarian-new"));
        let old = parent.join(format!("{name}.planarian-old"));
        // A planarian killed between the two renames below: the old copy is the upper dir.
        if !self.upperdir.exists() && old.is_dir() {
            sys::Context::at(std::fs::rename(&old, &self.upperdir), "put the previous files back at", &self.upperdir)?;
        }
        let _ = std::fs::remove_dir_all(&fresh);
        copy_tree(&saved, &fresh)?;
        // A leftover from a crash: the current upper dir is the truth, drop the old copy.
        let _ = std::fs::remove_dir_all(&old);
        sys::Context::at(std::fs::rename(&self.upperdir, &old), "move aside", &self.upperdir)?;
        if let Err(e) = std::fs::rename(&fresh, &self.upperdir) {
            let _ = std::fs::rename(&old, &self.upperdir);
            return Err(sys::IoError::new("put the statepoint's files in place at", &self.upperdir, e).into());
        }
        let current = self.upperdir.clone();
        let previous = old.clone();
        Ok(RestoreGuard::new(
            Box::new(move || {
                let _ = std::fs::remove_dir_all(&current);
                Ok(sys::Context::at(std::fs::rename(&previous, &current), "put the previous files back at", &current)?)
            }),
            Box::new(move || {
                let _ = std::fs::remove_dir_all(old);
            }),
        ))
    }

    /// Started as soon as the container is frozen: the comparison in a thread of its own, beside
    /// the safety statepoint and the page plan (it only reads).
    fn in_place_start(&self, sp_dir: &Path, local: &LocalState, at: &InPlaceAt) -> Option<super::files::InPlaceStart> {
        let (saved, upper, at) = (saved_of(sp_dir, local), self.upperdir.clone(), at.clone());
        let thread: Planning = std::thread::spawn(move || compare(&saved, &upper, &at));
        Some(super::files::InPlaceStart::new(thread))
    }

    fn in_place(
        &self,
        sp_dir: &Path,
        local: &LocalState,
        at: &InPlaceAt,
        start: Option<super::files::InPlaceStart>,
    ) -> Result<InPlaceFiles> {
        let sync = match start.and_then(|s| s.work.downcast::<Planning>().ok()) {
            Some(thread) => thread.join().unwrap_or_else(|p| std::panic::resume_unwind(p))?,
            None => compare(&saved_of(sp_dir, local), &self.upperdir, at)?,
        };
        Ok(InPlaceFiles { sync, cleanup: None, leftovers: vec![] })
    }
}

/// The comparison a rollback in place began early.
type Planning = std::thread::JoinHandle<Result<super::treesync::Sync>>;

/// Where a statepoint keeps its copy of the writable layer.
fn saved_of(sp_dir: &Path, local: &LocalState) -> std::path::PathBuf {
    sp_dir.join(local.rootfs_copy_path.as_deref().unwrap_or("rootfs"))
}

/// The statepoint's copy of the writable layer (`saved`) against the live one (`upper`), the
/// changes to be written through the container's root.
fn compare(saved: &Path, upper: &Path, at: &InPlaceAt) -> Result<super::treesync::Sync> {
    if !saved.is_dir() {
        return Err(Error::FilesMissing(saved.to_path_buf()));
    }
    if at.lowers.is_empty() {
        return Err(Error::InPlaceFiles("the container's root is not an overlay with lower layers".into()));
    }
    Ok(super::treesync::plan(saved, upper, &at.root, &at.lowers, false, &at.mounted)?)
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

        // A planarian killed between moving the upper dir aside and putting the copy in place.
        std::fs::write(upper.join("etc/app.conf"), "v3").unwrap();
        std::fs::rename(&upper, base.join("diff.planarian-old")).unwrap();
        let guard = r.restore(&sp1, &local).unwrap();
        assert_eq!(std::fs::read_to_string(upper.join("etc/app.conf")).unwrap(), "v1");
        guard.undo().unwrap();
        assert_eq!(std::fs::read_to_string(upper.join("etc/app.conf")).unwrap(), "v3", "the old copy was the truth");
        std::fs::remove_dir_all(&base).unwrap();
    }
}

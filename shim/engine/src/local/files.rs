//! The files part of a statepoint: the interface every backend implements (the copy of any
//! overlay's writable layer, ZFS datasets), and the guard of a restore.

use super::Result;
use crate::store::LocalState;
use std::path::Path;

pub trait Rootfs: Send + Sync {
    /// The name recorded in the manifest ("copy", "zfs").
    fn backend(&self) -> &'static str;
    /// Where statepoint `sp` (directory `sp_dir`) will keep its files: the manifest's fields,
    /// written before the snapshot so a crash half-way can be cleaned up.
    fn plan(&self, sp: &str, local: &mut LocalState);
    /// Captures the files as `local` says. Container frozen.
    fn snapshot(&self, sp_dir: &Path, local: &LocalState) -> Result<()>;
    /// Drops what [`Rootfs::snapshot`] captured, for a statepoint that is not committed.
    fn discard(&self, sp_dir: &Path, local: &LocalState);
    /// Makes the files exactly what statepoint `local` (in `sp_dir`) holds. The container does
    /// not run. Returns a guard that, unless committed, puts the previous files back.
    fn restore(&self, sp_dir: &Path, local: &LocalState) -> Result<RestoreGuard>;
    /// Prepares putting statepoint `local`'s files back under the running, frozen container
    /// (a rollback in place). Nothing changes
    /// until [`InPlaceFiles::apply`]; an error means this backend cannot do it now.
    /// `start`: what [`Rootfs::in_place_start`] began.
    fn in_place(&self, sp_dir: &Path, local: &LocalState, at: &InPlaceAt, start: Option<InPlaceStart>) -> Result<InPlaceFiles>;
    /// Begins, the container frozen and nothing else yet decided, what [`Rootfs::in_place`]
    /// will need, while the caller does other work. Dropped unused, it undoes what it made.
    /// `None`: nothing to begin.
    fn in_place_start(&self, _sp_dir: &Path, _local: &LocalState, _at: &InPlaceAt) -> Option<InPlaceStart> {
        None
    }
}

/// What [`Rootfs::in_place_start`] began, for the same backend's [`Rootfs::in_place`].
pub struct InPlaceStart(pub Box<dyn std::any::Any + Send>);

/// Where a rollback in place puts files back.
#[derive(Debug, Clone)]
pub struct InPlaceAt {
    /// The container's root as its processes see it (`/proc/PID/root`).
    pub root: std::path::PathBuf,
    /// The overlay's lower layers (top first), when the root is an overlay.
    pub lowers: Vec<std::path::PathBuf>,
    /// The container's mount points, relative to its root: not its files.
    pub mounted: Vec<std::path::PathBuf>,
    /// A directory the backend may use.
    pub scratch: std::path::PathBuf,
}

/// The files' part of a rollback in place, prepared: applied, or dropped (what it set up to
/// compare, a ZFS clone, goes away either way).
pub struct InPlaceFiles {
    pub sync: super::treesync::Sync,
    pub cleanup: Option<Box<dyn FnOnce()>>,
    /// The ZFS clone and snapshot `cleanup` destroys, if that is what it does.
    pub leftovers: Vec<String>,
}

impl InPlaceFiles {
    /// Entries changed.
    pub fn apply(&self) -> Result<usize> {
        self.sync.apply().map_err(super::Error::InPlaceFiles)
    }

    /// The ZFS clone and snapshot to destroy, left to the caller (who destroys them later,
    /// elsewhere, with [`super::zfs::destroy_clone`]); dropping this then destroys nothing.
    pub fn hand_off(mut self) -> Vec<String> {
        self.cleanup = None;
        std::mem::take(&mut self.leftovers)
    }
}

impl Drop for InPlaceFiles {
    fn drop(&mut self) {
        if let Some(c) = self.cleanup.take() {
            c();
        }
    }
}

type Undo = Box<dyn FnOnce() -> Result<()>>;

/// Keeps the files as they were before a restore until [`RestoreGuard::commit`]; dropping it
/// uncommitted puts them back.
pub struct RestoreGuard {
    undo: Option<Undo>,
    commit: Option<Box<dyn FnOnce()>>,
}

impl RestoreGuard {
    pub fn new(undo: Undo, commit: Box<dyn FnOnce()>) -> RestoreGuard {
        RestoreGuard { undo: Some(undo), commit: Some(commit) }
    }

    pub fn commit(mut self) {
        self.undo = None;
        if let Some(c) = self.commit.take() {
            c();
        }
    }

    /// Puts the previous files back now.
    pub fn undo(mut self) -> Result<()> {
        self.undo_inner()
    }

    fn undo_inner(&mut self) -> Result<()> {
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

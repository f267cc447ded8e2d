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

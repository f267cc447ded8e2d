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
    /// Told, the container frozen and before [`Rootfs::snapshot`], which processes it has: a
    /// backend that copies only what changed looks at what they map.
    fn processes(&self, _pids: &[i32]) {}
    /// Drops what [`Rootfs::snapshot`] captured, for a statepoint that is not committed.
    fn discard(&self, sp_dir: &Path, local: &LocalState);
    /// Makes the files exactly what statepoint `local` (in `sp_dir`) holds. The container does
    /// not run. Returns a guard that, unless committed, puts the previous files back.
    fn restore(&self, sp_dir: &Path, local: &LocalState) -> Result<RestoreGuard>;
    /// Prepares putting statepoint `local`'s files back under the running, frozen container
    /// (a rollback in place). Nothing changes
    /// until [`InPlaceFiles::apply`]; an error means this backend cannot do it now.
    /// `start`: what [`Rootfs::in_place_start`] began.
    fn in_place(
        &self,
        sp_dir: &Path,
        local: &LocalState,
        at: &InPlaceAt,
        start: Option<InPlaceStart>,
    ) -> Result<InPlaceFiles>;
    /// Begins, the container frozen and nothing else yet decided, what [`Rootfs::in_place`]
    /// will need, while the caller does other work. Dropped unused, it undoes what it made.
    /// `None`: nothing to begin. `prepared`: what [`Rootfs::in_place_prepare`] began.
    fn in_place_start(
        &self,
        _sp_dir: &Path,
        _local: &LocalState,
        _at: &InPlaceAt,
        _prepared: Option<InPlaceStart>,
    ) -> Option<InPlaceStart> {
        None
    }
    /// Begins, before the container is frozen, what [`Rootfs::in_place_start`] will need that
    /// the frozen state does not change (on OpenZFS: the statepoint's snapshot, mounted where it
    /// can be read, in `scratch`). Dropped unused, it undoes what it made.
    fn in_place_prepare(&self, _local: &LocalState, _scratch: &Path) -> Option<InPlaceStart> {
        None
    }
}

/// What [`Rootfs::in_place_start`] began, for the same backend's [`Rootfs::in_place`].
pub struct InPlaceStart {
    pub work: Box<dyn std::any::Any + Send>,
}

impl InPlaceStart {
    pub fn new(work: impl std::any::Any + Send) -> InPlaceStart {
        InPlaceStart { work: Box::new(work) }
    }
}

/// Files of the frozen state a rollback in place captures for its comparison (on ZFS: the
/// snapshot it compares the statepoint with), beside other work. Whoever captures them says how
/// that went ([`Capturing::made`]; a capturer that ends without saying has failed); once made,
/// they are the capturer's to remove.
#[derive(Clone)]
pub struct TakenFiles(std::sync::Arc<Taken>);

struct Taken {
    /// What was captured (the ZFS snapshot's full name).
    name: String,
    state: std::sync::Mutex<Capture>,
}

/// Where the captured files stand.
#[derive(Clone)]
enum Capture {
    Underway,
    Made,
    Failed,
}

impl TakenFiles {
    pub fn new(name: String) -> TakenFiles {
        TakenFiles(std::sync::Arc::new(Taken { name, state: std::sync::Mutex::new(Capture::Underway) }))
    }

    pub fn name(&self) -> &str {
        &self.0.name
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Capture> {
        self.0.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Says how capturing went (the first word counts).
    fn made(&self, made: bool) {
        let mut s = self.state();
        if matches!(*s, Capture::Underway) {
            *s = if made { Capture::Made } else { Capture::Failed };
        }
    }

    /// Captured: the capturer's to remove. (Not captured, there is nothing of them.)
    pub fn capturers(&self) -> bool {
        matches!(*self.state(), Capture::Made)
    }

    /// Says, when dropped without having said anything, that capturing failed.
    pub fn capturing(&self) -> Capturing {
        Capturing(self.clone())
    }
}

impl std::fmt::Debug for TakenFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TakenFiles({})", self.0.name)
    }
}

/// See [`TakenFiles::capturing`].
pub struct Capturing(TakenFiles);

impl Capturing {
    pub fn made(&self, made: bool) {
        self.0.made(made)
    }
}

impl Drop for Capturing {
    fn drop(&mut self) {
        self.0.made(false);
    }
}

/// The directory a rollback in place's files part may use: where a ZFS backend mounts the
/// statepoint's files.
pub fn in_place_scratch(store: &crate::store::ContainerStore) -> std::path::PathBuf {
    store.dir.join("in-place-files")
}

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
/// compare, the statepoint's view on ZFS, goes away either way).
pub struct InPlaceFiles {
    pub sync: super::treesync::Sync,
    pub cleanup: Option<Box<dyn FnOnce()>>,
    /// What `cleanup` removes on ZFS ([`super::zfs::remove_leftover`]): the statepoint's view
    /// and the snapshot of the frozen state.
    pub leftovers: Vec<String>,
}

impl InPlaceFiles {
    /// Entries changed.
    pub fn apply(&self) -> Result<usize> {
        Ok(self.sync.apply()?)
    }

    /// What is left to remove on ZFS, left to the caller (who removes it later, elsewhere, with
    /// [`super::zfs::remove_leftover`]); dropping this then removes nothing.
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

#[cfg(test)]
mod tests {
    use super::TakenFiles;

    #[test]
    fn a_capture_that_ends_without_a_word_failed_and_leaves_nothing_to_remove() {
        let t = TakenFiles::new("s".into());
        drop(t.capturing());
        assert!(!t.capturers(), "never made: nothing to remove");
        t.capturing().made(true);
        assert!(!t.capturers(), "the first word counts");
    }

    #[test]
    fn made_is_the_capturers() {
        let t = TakenFiles::new("s".into());
        t.capturing().made(true);
        assert!(t.capturers());
    }
}

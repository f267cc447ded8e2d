//! Local state: what a statepoint captures on this host. The CRIU driver ([`criu`]), the
//! freezer, the container's `/dev` ([`devfs`]), and the files ([`files`]: the interface, with a
//! copy backend that works everywhere and a ZFS one, [`zfs`]).

pub(crate) mod copy;
pub mod criu;
pub(crate) mod devfs;
pub mod files;
pub mod freezer;
pub(crate) mod inplace;
pub mod lazy;
pub(crate) mod treesync;
pub(crate) mod unchanged;
pub mod zfs;

use crate::config::Config;
use crate::store::ContainerStore;
use files::Rootfs;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Io(#[from] sys::IoError),
    #[error("{what}: {source}")]
    Json { what: String, source: serde_json::Error },
    #[error(transparent)]
    Tool(#[from] crate::tools::NotFound),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Runtime(#[from] crate::runtime::Error),
    #[error(transparent)]
    Zfs(#[from] ::zfs::Error),
    #[error(transparent)]
    Lazy(Box<lazy::Error>),
    #[error(transparent)]
    Store(#[from] crate::store::Error),
    #[error("cannot run {tool}: {source}")]
    Run { tool: PathBuf, source: std::io::Error },
    #[error("copying {} failed: {why}", from.display())]
    Copy { from: PathBuf, why: String },
    #[error("no cgroup freezer found for process {0}")]
    NoFreezer(i32),
    #[error("the container's cgroup {} did not freeze within 10 s", .0.display())]
    DidNotFreeze(PathBuf),
    #[error("cannot mount a tmpfs for /dev on {} ({options}): {source}", at.display())]
    DevMount { at: PathBuf, options: String, source: nix::Error },
    #[error("cannot recreate /dev entry {}: {why}", path.display())]
    DevEntry { path: PathBuf, why: String },
    #[error("container {0}'s rootfs is neither a ZFS dataset nor an overlay: planarian cannot keep its files")]
    NoFilesBackend(String),
    #[error("the statepoint's files are missing from {}", .0.display())]
    FilesMissing(PathBuf),
    #[error("the container's files are still mounted ({}); stop it first", .0.display())]
    FilesMounted(PathBuf),
    #[error("the statepoint has no ZFS snapshot (it was taken on the copy-based path)")]
    NoZfsSnapshot,
    #[error("the statepoint's snapshot {name} is missing from pool {pool}")]
    SnapshotMissing { name: String, pool: String },
    #[error("dataset {dataset} has no mount point (mountpoint={mountpoint}); give its parent one")]
    NoMountPoint { dataset: String, mountpoint: String },
    #[error("the container's files are in use ({0} is busy: a process has a file or directory open there); nothing was changed")]
    FilesBusy(String),
    #[error("the ZFS pool {pool} is full: cannot snapshot the container's files ({source})")]
    PoolFull { pool: String, source: ::zfs::Error },
    #[error("dataset {0} already exists; remove it (zfs destroy -r {0}) or unset the parent dataset")]
    DatasetExists(String),
    #[error("the checkpoint's files are a ZFS stream: restoring it needs ZFS here (set [zfs] parent_dataset, or the annotation io.planarian.zfs.parent_dataset)")]
    NeedsZfs,
    #[error("the checkpoint's files are an incremental ZFS stream, and pool {0} holds no snapshot it starts from (import the statepoint it was exported --since first)")]
    NoCommonSnapshot(String),
    #[error("cannot roll back the files on {dataset}: {users} run on clones of its snapshots (a fork, or an import on top of it), and ZFS cannot swap the dataset while they are mounted; stop them first (nothing was changed)")]
    ClonesInUse { dataset: String, users: String },
    #[error("parent dataset {0} does not exist (zfs create {0}, or fix [zfs] parent_dataset)")]
    NoParentDataset(String),
    #[error("{what}: {source}")]
    ZfsStep { what: String, source: ::zfs::Error },
    #[error("cannot copy the image into {dataset}: {source}")]
    ImageCopy { dataset: String, source: Box<Error> },
    #[error("files in place: {0}")]
    InPlaceFiles(String),
    #[error("files in place: {0}")]
    Sync(#[from] treesync::SyncError),
    /// An undo that failed after the step it undoes failed: both are told.
    #[error("{first}; and {undoing} failed: {then}")]
    UndoFailed { first: Box<Error>, undoing: &'static str, then: Box<Error> },
}

impl From<lazy::Error> for Error {
    fn from(e: lazy::Error) -> Error {
        match e {
            lazy::Error::Local(l) => *l,
            e => Error::Lazy(Box::new(e)),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The files backend of a container: its ZFS dataset when it has one, else a copy of its
/// overlay writable layer.
pub fn rootfs_for(
    cfg: &Config,
    store: &ContainerStore,
    id: &str,
    upperdir: Option<PathBuf>,
) -> Result<Box<dyn Rootfs>> {
    if let Some(z) = zfs::ZfsRootfs::for_container(cfg, store, id)? {
        return Ok(Box::new(z));
    }
    let upperdir = upperdir.ok_or_else(|| Error::NoFilesBackend(id.to_string()))?;
    Ok(Box::new(copy::CopyRootfs::new(upperdir, Some(store.dir.clone()))))
}

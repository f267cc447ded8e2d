//! The statepoint registry: one directory per statepoint with its manifest, per container a
//! lock and a ledger.
//!
//! ```text
//! <store>/containers/<container-id>/
//!     lock                     flock: exclusive for snapshot/rollback, shared for tool calls
//!     frozen-by-planarian      present while planarian holds the cgroup frozen
//!     head                     the statepoint the running sandbox continues from
//!     handoff                  a rollback handing its lock to the restore it started
//!     statepoints/<id>/        manifest.json, criu/ (images), rootfs/ (copy-based files)
//!     zfs.json                 the container's ZFS dataset, when it has one (local/zfs)
//! ```
//!
//! The registry knows manifests, ids, the head and the lock; what a statepoint's parts are made
//! of (images, files, datasets) is for the layers above it, which remove them (the statepoint
//! manager's `remove`).

use serde::{Deserialize, Serialize};
use std::fs::File;
use std::path::{Path, PathBuf};
use sys::Context;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Io(#[from] sys::IoError),
    #[error("{}: {source}", path.display())]
    Manifest { path: PathBuf, source: serde_json::Error },
    #[error("unknown statepoint {0} (see `planarian statepoint list`)")]
    Unknown(String),
    #[error("still in flight after {waited} s ({what}): nothing was done; try again when it has ended ([checkpoint] in_flight_wait_seconds)")]
    InFlight { waited: u64, what: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pending,
    Committed,
    Discarded,
}

/// The paper's state evidence: what the state is (recorded at snapshot time) and what happened
/// after it (appended later; never changes the captured state).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct Evidence {
    pub state_description: String,
    /// Structured state the caller recorded (task progress, a score, …): StateRecord.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<serde_json::Value>,
    /// What happened after this statepoint: AppendOutcome.
    #[serde(default)]
    pub prior_outcomes: Vec<Outcome>,
}

/// One outcome of what followed a statepoint.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case", from = "OutcomeRecord")]
pub struct Outcome {
    pub text: String,
    pub status: OutcomeStatus,
    pub by: Actor,
    /// A score, for harnesses that back rewards up a tree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward: Option<f64>,
    /// When it was appended (RFC 3339, UTC); empty for outcomes older manifests kept as text.
    #[serde(default)]
    pub time: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutcomeStatus {
    Success,
    Failure,
    /// The branch after this statepoint was left by a rollback.
    Abandoned,
    Info,
}

/// Who appended an outcome: one of the paper's three stakeholders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Actor {
    User,
    Harness,
    Agent,
}

/// An outcome as manifests have held it: an object, or (before outcomes had a status) its text.
#[derive(Deserialize)]
#[serde(untagged)]
enum OutcomeRecord {
    Full {
        text: String,
        status: OutcomeStatus,
        by: Actor,
        #[serde(default)]
        reward: Option<f64>,
        #[serde(default)]
        time: String,
    },
    Text(String),
}

impl From<OutcomeRecord> for Outcome {
    fn from(r: OutcomeRecord) -> Outcome {
        match r {
            OutcomeRecord::Full { text, status, by, reward, time } => Outcome { text, status, by, reward, time },
            OutcomeRecord::Text(text) => {
                Outcome { text, status: OutcomeStatus::Info, by: Actor::User, reward: None, time: String::new() }
            }
        }
    }
}

impl Outcome {
    /// A new outcome, timed now.
    pub fn now(text: impl Into<String>, status: OutcomeStatus, by: Actor, reward: Option<f64>) -> Outcome {
        Outcome { text: text.into(), status, by, reward, time: crate::log::rfc3339(std::time::SystemTime::now()) }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct LocalState {
    /// Relative to the statepoint directory.
    pub criu_checkpoint_path: String,
    pub zfs_snapshot: Option<String>,
    /// Which rootfs path this statepoint used: "copy" or "zfs".
    pub rootfs_backend: String,
    /// The copy of the writable layer (copy backend), relative to the statepoint directory.
    pub rootfs_copy_path: Option<String>,
    /// The container's writable layer when the statepoint was taken.
    pub rootfs_upperdir: Option<String>,
    /// ZFS: the host's clocks just before the statepoint's snapshot was taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zfs_clock: Option<Clock>,
    /// The container's processes that were not in its process tree, and so not in the statepoint
    /// (the command of an exec still running: its parent is conmon, outside the container), as
    /// `process N (COMMAND)`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outside_tree: Vec<String>,
}

/// The host's clocks at one moment: the wall clock, the time since boot, and which boot.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct Clock {
    /// Seconds since the epoch.
    pub wall: u64,
    /// Seconds since boot (`/proc/uptime`).
    pub uptime: f64,
    pub boot_id: String,
}

impl Clock {
    pub fn now() -> Option<Clock> {
        let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok()?.as_secs();
        let uptime = sys::proc::system("uptime").ok()?.split_whitespace().next()?.parse().ok()?;
        let boot_id = sys::proc::system("sys/kernel/random/boot_id").ok()?.trim().to_string();
        Some(Clock { wall, uptime, boot_id })
    }

    /// Whether the wall clock kept time from `self` to `now`: the same boot, and the wall clock
    /// moved as the time since boot did (within `slack` seconds: it was not set back, or
    /// forward, in between — as far as two readings can tell).
    pub fn kept_time_to(&self, now: &Clock, slack: f64) -> bool {
        let (wall, up) = (now.wall as f64 - self.wall as f64, now.uptime - self.uptime);
        self.boot_id == now.boot_id && up >= 0.0 && (wall - up).abs() <= slack
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct RemoteState {
    pub external_endpoint: Option<String>,
    pub mcp_call_position: Option<u64>,
    pub hook_path: Option<String>,
    /// The calls since the parent statepoint that changed something on this branch, and what
    /// they changed (tables), when the hook says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calls_since_parent: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tables_since_parent: Option<Vec<String>>,
    /// Tools were let through unrecorded (the user's explicit pass) at or before this
    /// statepoint: its remote state does not cover what they changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uncovered: Option<Uncovered>,
}

/// What a remote state does not cover: the tools let through unrecorded, since which position.
pub use planarian_contracts::Uncovered;

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct Options {
    pub tcp_established: bool,
    pub file_locks: bool,
    pub leave_running: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct Measurements {
    pub freeze_ms: f64,
    pub criu_dump_ms: f64,
    pub rootfs_ms: f64,
    pub frozen_ms: f64,
    pub total_ms: f64,
    pub criu_bytes: u64,
    /// What the statepoint's copy of the files added to the disk (files it shares with an
    /// earlier copy not counted).
    pub rootfs_bytes: u64,
    /// From CRIU's stats: memory pages written by this dump and found in the parent instead.
    #[serde(default)]
    pub pages_written: u64,
    #[serde(default)]
    pub pages_skipped_parent: u64,
}

/// Where this statepoint's memory dump sits in its incremental chain (Algorithm 1).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct Chain {
    /// The parent images, relative to this statepoint's images (CRIU's `--prev-images-dir`);
    /// none for a full dump.
    pub prev_images_dir: Option<String>,
    /// Incremental dumps since the last full one.
    pub depth: u32,
    /// Why this dump is full, when it is.
    pub full_reason: Option<String>,
    /// The statepoint whose memory images these are: its processes did nothing since (no dump).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub same_as: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct Manifest {
    pub statepoint_id: String,
    pub parent_statepoint_id: Option<String>,
    pub branch_id: String,
    pub container_id: String,
    pub timestamp: String,
    pub name: Option<String>,
    pub state_evidence: Evidence,
    pub local_state: LocalState,
    pub remote_state: Vec<RemoteState>,
    pub status: Status,
    /// Internal statepoints (the safety copy a rollback takes) are not listed.
    #[serde(default)]
    pub internal: bool,
    pub options: Options,
    pub measurements: Measurements,
    #[serde(default)]
    pub chain: Chain,
    /// Where an imported statepoint came from (`<container>/<statepoint>` of the store that
    /// made it): a chain that starts here with images made elsewhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imported_from: Option<String>,
    /// Every rollback to this statepoint: which path it took (in place, with the pages it
    /// wrote, or stop and restore, and why).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rollbacks: Vec<How>,
    /// Why this statepoint can no longer be restored: a rollback to an earlier one undid the
    /// remote calls it holds (compensation cannot be rolled forward).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unreachable: Option<String>,
}

/// The path a rollback took (or that a fork was a spare handed out).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "kebab-case")]
pub struct How {
    /// "in-place" or "stop-and-restore" (a rollback); "spare" (a fork from a spare).
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pages_written: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pages_dropped: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files_changed: Option<u64>,
    /// On ZFS, the places of the objects changed since the statepoint that were examined (set
    /// only when no directory had to be compared whole).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub places_examined: Option<u64>,
    /// Where those places came from: `stream` (the changed objects' own znodes, in the
    /// incremental stream) or `zdb`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub places_from: Option<String>,
    /// Why the rollback did not run in place, when it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_in_place: Option<String>,
    /// The processes a rollback in place ended, as the statepoint does not have them (started
    /// since, or outside the tree it holds): `process 12 (sleep)`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes_ended: Vec<String>,
}

/// One container's part of the store.
#[derive(Debug, Clone)]
pub struct ContainerStore {
    pub dir: PathBuf,
}

impl ContainerStore {
    pub fn new(store: &Path, container_id: &str) -> ContainerStore {
        ContainerStore { dir: store.join("containers").join(container_id) }
    }

    pub fn statepoint_dir(&self, id: &str) -> PathBuf {
        self.dir.join("statepoints").join(id)
    }

    /// Takes the container's lock, exclusive or shared; released when the file is dropped,
    /// and by the kernel if planarian dies.
    pub fn lock(&self, exclusive: bool) -> Result<File> {
        self.lock_file("lock", exclusive)
    }

    /// For a writer of notes that holds the container's lock only shared (a fork noting itself
    /// on its source, beside tool calls): this one exclusive, so two such writers take turns.
    /// Every other manifest writer holds the container's lock exclusive, which excludes them.
    pub fn notes_lock(&self) -> Result<File> {
        self.lock_file("notes.lock", true)
    }

    fn lock_file(&self, name: &str, exclusive: bool) -> Result<File> {
        std::fs::create_dir_all(&self.dir).at("create", &self.dir)?;
        let path = self.dir.join(name);
        let f = File::options().create(true).truncate(false).write(true).open(&path).at("open", &path)?;
        let r = if exclusive { f.lock() } else { f.lock_shared() };
        r.at("lock", &path)?;
        Ok(f)
    }

    /// The container's lock, exclusive, for a statepoint operation: it waits for the tool calls
    /// in flight (a `podman exec` still running, an MCP call), at most `wait`, telling
    /// `waiting` first what it waits for.
    pub fn lock_for_statepoint(&self, wait: std::time::Duration, waiting: &mut dyn FnMut(&str)) -> Result<File> {
        std::fs::create_dir_all(&self.dir).at("create", &self.dir)?;
        let path = self.dir.join("lock");
        let f = File::options().create(true).truncate(false).write(true).open(&path).at("open", &path)?;
        // (the holders of `exec`s let go at the latest `wait` after the command started)
        let wait = wait + std::time::Duration::from_secs(5);
        crate::runtime::inflight::lock_within(f, &self.dir, wait, waiting)
            .map_err(|what| Error::InFlight { waited: wait.as_secs(), what })
    }

    /// The container's lock if it can be had now; `None` while another operation holds it.
    pub fn try_lock(&self, exclusive: bool) -> Result<Option<File>> {
        std::fs::create_dir_all(&self.dir).at("create", &self.dir)?;
        let path = self.dir.join("lock");
        let f = File::options().create(true).truncate(false).write(true).open(&path).at("open", &path)?;
        let r = if exclusive { f.try_lock() } else { f.try_lock_shared() };
        match r {
            Ok(()) => Ok(Some(f)),
            Err(std::fs::TryLockError::WouldBlock) => Ok(None),
            Err(std::fs::TryLockError::Error(e)) => Err(sys::IoError::new("lock", path, e).into()),
        }
    }

    /// The container ID this store belongs to (its directory's name).
    pub fn container_id(&self) -> String {
        self.dir.file_name().unwrap_or_default().to_string_lossy().into_owned()
    }

    pub fn head(&self) -> Option<String> {
        std::fs::read_to_string(self.dir.join("head")).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
    }

    pub fn set_head(&self, id: Option<&str>) -> Result<()> {
        let path = self.dir.join("head");
        match id {
            Some(id) => Ok(sys::write_atomic(&path, id.as_bytes(), 0o644)?),
            None => match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(sys::IoError::new("remove", path, e).into()),
                _ => Ok(()),
            },
        }
    }

    /// All statepoints with a readable manifest, oldest first.
    pub fn manifests(&self) -> Vec<Manifest> {
        self.read_each(|m: &Manifest| &m.statepoint_id)
    }

    /// Every statepoint's manifest that reads as a `T`, oldest first (by the id `id` gives).
    fn read_each<T: serde::de::DeserializeOwned>(&self, id: impl Fn(&T) -> &str) -> Vec<T> {
        let mut v: Vec<T> = std::fs::read_dir(self.dir.join("statepoints"))
            .map(|rd| {
                rd.filter_map(Result::ok)
                    .filter_map(|e| serde_json::from_slice(&std::fs::read(e.path().join("manifest.json")).ok()?).ok())
                    .collect()
            })
            .unwrap_or_default();
        v.sort_by_key(|m| seq_of(id(m)));
        v
    }

    pub fn committed(&self) -> Vec<Manifest> {
        self.manifests().into_iter().filter(|m| m.status == Status::Committed && !m.internal).collect()
    }

    /// What every statepoint with a readable manifest is, oldest first: its id, parent, name,
    /// status and images, read without the rest of its manifest (an operation looks through all
    /// of them, up to `store.retention` and more, and reads in full only what it acts on).
    pub fn summaries(&self) -> Vec<Summary> {
        self.read_each(|m: &Summary| &m.statepoint_id)
    }

    /// Finds a committed statepoint by id or name: an id is read where it is; otherwise the
    /// oldest committed statepoint of that name (new names never have an id's shape,
    /// `statepoint::check_name`, but an older store's may).
    pub fn find(&self, key: &str) -> Result<Manifest> {
        let committed = |id: &str| {
            let m = read_manifest(&self.statepoint_dir(id).join("manifest.json")).ok()?;
            (m.status == Status::Committed && m.statepoint_id == id).then_some(m)
        };
        if let Some(m) = Some(key).filter(|k| is_id(k)).and_then(committed) {
            return Ok(m);
        }
        (self.summaries().into_iter())
            .filter(|m| m.status == Status::Committed && m.name.as_deref() == Some(key))
            .find_map(|m| committed(&m.statepoint_id))
            .ok_or_else(|| Error::Unknown(key.to_string()))
    }

    /// The next statepoint id: sp1, sp2, … (never reused within a container: not an id in the
    /// counter, nor one a directory has, with a manifest or not).
    pub fn next_id(&self) -> String {
        let counter = self.dir.join("counter");
        let last: u64 = std::fs::read_to_string(&counter).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0);
        let max_dir = std::fs::read_dir(self.dir.join("statepoints"))
            .map(|rd| rd.filter_map(Result::ok).map(|e| seq_of(&e.file_name().to_string_lossy())).max().unwrap_or(0))
            .unwrap_or(0);
        let n = last.max(max_dir) + 1;
        let _ = sys::write_atomic(&counter, n.to_string().as_bytes(), 0o644);
        format!("sp{n}")
    }

    pub fn write_manifest(&self, m: &Manifest) -> Result<()> {
        let path = self.statepoint_dir(&m.statepoint_id).join("manifest.json");
        let data = serde_json::to_vec_pretty(m).map_err(|source| Error::Manifest { path: path.clone(), source })?;
        Ok(sys::write_atomic(&path, &data, 0o644)?)
    }

    /// Statepoint directories a crashed planarian left: pending manifests, and directories with
    /// no manifest at all (partial creations). The caller removes their parts.
    pub fn stale(&self) -> (Vec<Manifest>, Vec<PathBuf>) {
        let pending = (self.summaries().into_iter())
            .filter(|m| m.status == Status::Pending)
            .filter_map(|m| read_manifest(&self.statepoint_dir(&m.statepoint_id).join("manifest.json")).ok())
            .filter(|m| m.status == Status::Pending)
            .collect();
        let orphans = std::fs::read_dir(self.dir.join("statepoints"))
            .map(|rd| {
                rd.filter_map(Result::ok).map(|e| e.path()).filter(|p| !p.join("manifest.json").exists()).collect()
            })
            .unwrap_or_default();
        (pending, orphans)
    }

    /// Marks a statepoint discarded: the first step of removing it, so that a crash half-way
    /// leaves no committed statepoint without its parts. Clears the head if it pointed there.
    pub fn mark_discarded(&self, id: &str) -> Result<Manifest> {
        let dir = self.statepoint_dir(id);
        let mut m = read_manifest(&dir.join("manifest.json"))?;
        m.status = Status::Discarded;
        self.write_manifest(&m)?;
        if self.head().as_deref() == Some(id) {
            self.set_head(None)?;
        }
        Ok(m)
    }
}

/// A manifest's fields a look through every statepoint needs ([`ContainerStore::summaries`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Summary {
    pub statepoint_id: String,
    pub parent_statepoint_id: Option<String>,
    pub name: Option<String>,
    pub status: Status,
    #[serde(default)]
    pub internal: bool,
    pub local_state: SummaryLocal,
}

/// Of a [`Summary`]'s local state, where its images are.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct SummaryLocal {
    pub criu_checkpoint_path: String,
}

/// Whether `key` has a statepoint id's shape: `sp` and digits.
pub fn is_id(key: &str) -> bool {
    key.strip_prefix("sp").is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
}

pub fn read_manifest(path: &Path) -> Result<Manifest> {
    let data = std::fs::read(path).at("read", path)?;
    serde_json::from_slice(&data).map_err(|source| Error::Manifest { path: path.to_path_buf(), source })
}

fn seq_of(id: &str) -> u64 {
    id.trim_start_matches("sp").parse().unwrap_or(0)
}

/// Size of a directory tree in bytes (allocated blocks, so sparse files count what they use).
pub fn du(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(md) = std::fs::symlink_metadata(path) else { return 0 };
    let mut total = md.blocks() * 512;
    if md.is_dir() {
        if let Ok(rd) = std::fs::read_dir(path) {
            for e in rd.filter_map(Result::ok) {
                total += du(&e.path());
            }
        }
    }
    total
}

/// [`du`], without the regular files another statepoint's copy shares (hard links): what the
/// tree added to the disk. A file with several names counts once, when all of them are in it.
pub fn du_unshared(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut linked: std::collections::HashMap<(u64, u64), (u64, u64)> = Default::default();
    let mut todo = vec![path.to_path_buf()];
    while let Some(p) = todo.pop() {
        let Ok(md) = std::fs::symlink_metadata(&p) else { continue };
        if md.is_file() && md.nlink() > 1 {
            let seen = linked.entry((md.dev(), md.ino())).or_insert((0, md.nlink()));
            seen.0 += 1;
            if seen.0 == seen.1 {
                total += md.blocks() * 512;
            }
            continue;
        }
        total += md.blocks() * 512;
        if md.is_dir() {
            todo.extend(std::fs::read_dir(&p).into_iter().flatten().flatten().map(|e| e.path()));
        }
    }
    total
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn a_clock_kept_time_only_within_one_boot_and_with_the_uptime() {
        let then = Clock { wall: 1000, uptime: 50.0, boot_id: "a".into() };
        let at = |wall, uptime: f64, boot: &str| Clock { wall, uptime, boot_id: boot.into() };
        assert!(then.kept_time_to(&at(1100, 150.5, "a"), 2.0));
        assert!(!then.kept_time_to(&at(1100, 50.0, "a"), 2.0), "set forward");
        assert!(!then.kept_time_to(&at(990, 60.0, "a"), 2.0), "set back");
        assert!(!then.kept_time_to(&at(1100, 150.0, "b"), 2.0), "another boot");
    }

    /// A scratch directory (removed when the first is dropped) and a path in it, not made.
    fn tmp(tag: &str) -> (tempfile::TempDir, PathBuf) {
        let scratch = tempfile::tempdir().unwrap();
        let d = scratch.path().join(tag);
        (scratch, d)
    }

    pub(crate) fn manifest(id: &str, status: Status) -> Manifest {
        Manifest {
            statepoint_id: id.into(),
            parent_statepoint_id: None,
            branch_id: "c".into(),
            container_id: "c".into(),
            timestamp: "t".into(),
            name: None,
            state_evidence: Evidence::default(),
            local_state: LocalState::default(),
            remote_state: vec![],
            status,
            internal: false,
            options: Options::default(),
            measurements: Measurements::default(),
            chain: Chain::default(),
            rollbacks: vec![],
            unreachable: None,
            imported_from: None,
        }
    }

    #[test]
    fn ids_are_sequential_and_never_reused() {
        let (_scratch, root) = tmp("ids");
        let s = ContainerStore::new(&root, "c");
        std::fs::create_dir_all(&s.dir).unwrap();
        assert_eq!(s.next_id(), "sp1");
        s.write_manifest(&manifest("sp1", Status::Committed)).unwrap();
        assert_eq!(s.next_id(), "sp2");
        s.mark_discarded("sp1").unwrap();
        std::fs::remove_dir_all(s.statepoint_dir("sp1")).unwrap();
        assert_eq!(s.next_id(), "sp3");
        // A directory a crash left without a manifest, its id past the counter: not reused.
        std::fs::create_dir_all(s.statepoint_dir("sp9").join("criu")).unwrap();
        assert_eq!(s.next_id(), "sp10");
    }

    #[test]
    fn stale_are_pending_statepoints_and_directories_without_a_manifest() {
        let (_scratch, root) = tmp("stale");
        let s = ContainerStore::new(&root, "c");
        s.write_manifest(&manifest("sp1", Status::Committed)).unwrap();
        s.write_manifest(&manifest("sp2", Status::Pending)).unwrap();
        std::fs::create_dir_all(s.statepoint_dir("sp3").join("criu")).unwrap();
        let (pending, orphans) = s.stale();
        assert_eq!(pending.iter().map(|m| m.statepoint_id.as_str()).collect::<Vec<_>>(), ["sp2"]);
        assert_eq!(orphans, [s.statepoint_dir("sp3")]);
    }

    #[test]
    fn find_by_id_or_name_only_committed() {
        let (_scratch, root) = tmp("find");
        let s = ContainerStore::new(&root, "c");
        let mut m = manifest("sp1", Status::Committed);
        m.name = Some("deps-installed".into());
        s.write_manifest(&m).unwrap();
        s.write_manifest(&manifest("sp2", Status::Pending)).unwrap();
        assert_eq!(s.find("deps-installed").unwrap().statepoint_id, "sp1");
        assert_eq!(s.find("sp1").unwrap().statepoint_id, "sp1");
        let e = s.find("sp2").unwrap_err().to_string();
        assert!(e.starts_with("unknown statepoint sp2"), "{e}");
        // A name of a statepoint not committed, an id with no statepoint, not an id: unknown.
        let mut p = manifest("sp3", Status::Pending);
        p.name = Some("half".into());
        s.write_manifest(&p).unwrap();
        for key in ["half", "sp7", "sp", "../sp1", "sp1/..", ""] {
            assert!(matches!(s.find(key), Err(Error::Unknown(_))), "{key}");
        }
        // An older store's name of an id's shape: found when no statepoint has that id; an id
        // is the statepoint's own first.
        for (id, name) in [("sp4", "sp9"), ("sp5", "sp1")] {
            let mut m = manifest(id, Status::Committed);
            m.name = Some(name.into());
            s.write_manifest(&m).unwrap();
        }
        assert_eq!(s.find("sp9").unwrap().statepoint_id, "sp4");
        assert_eq!(s.find("sp1").unwrap().statepoint_id, "sp1");
        // Two of one name, the older one's manifest not readable in full: the other.
        let mut m = manifest("sp7", Status::Committed);
        m.name = Some("dup".into());
        s.write_manifest(&m).unwrap();
        let mut v = serde_json::to_value(&m).unwrap();
        v["statepoint-id"] = "sp6".into();
        v["measurements"] = "not measurements".into();
        std::fs::create_dir_all(s.statepoint_dir("sp6")).unwrap();
        std::fs::write(s.statepoint_dir("sp6").join("manifest.json"), v.to_string()).unwrap();
        assert_eq!(s.find("dup").unwrap().statepoint_id, "sp7");
        // The summaries are the manifests' own, oldest first (the one only a summary reads too).
        let mut p = manifest("sp8", Status::Committed);
        (p.parent_statepoint_id, p.internal, p.local_state.criu_checkpoint_path) =
            (Some("sp7".into()), true, "criu-elsewhere".into());
        s.write_manifest(&p).unwrap();
        let full = |id: &str| read_manifest(&s.statepoint_dir(id).join("manifest.json")).ok();
        let sums = s.summaries();
        assert_eq!(
            sums.iter().map(|m| m.statepoint_id.as_str()).collect::<Vec<_>>(),
            ["sp1", "sp2", "sp3", "sp4", "sp5", "sp6", "sp7", "sp8"]
        );
        for sum in sums.iter().filter(|m| m.statepoint_id != "sp6") {
            let m = full(&sum.statepoint_id).unwrap();
            assert_eq!(
                (&sum.parent_statepoint_id, &sum.name, sum.status, sum.internal, &sum.local_state.criu_checkpoint_path),
                (&m.parent_statepoint_id, &m.name, m.status, m.internal, &m.local_state.criu_checkpoint_path)
            );
        }
        assert!(full("sp6").is_none() && sums[5].name.as_deref() == Some("dup"));
    }

    #[test]
    fn an_id_is_sp_and_digits() {
        for (key, id) in [("sp1", true), ("sp042", true), ("sp", false), ("sp1a", false), ("Sp1", false)] {
            assert_eq!(is_id(key), id, "{key}");
        }
        for key in ["../sp1", "sp1/..", "sp1/../sp2", "/sp1", "", " sp1"] {
            assert!(!is_id(key), "{key}");
        }
    }

    #[test]
    fn outcomes_of_older_manifests_read_as_info_by_the_user() {
        let e: Evidence =
            serde_json::from_value(serde_json::json!({"state-description": "d", "prior-outcomes": ["tests failed"]}))
                .unwrap();
        assert_eq!(e.prior_outcomes[0].text, "tests failed");
        assert_eq!((e.prior_outcomes[0].status, e.prior_outcomes[0].by), (OutcomeStatus::Info, Actor::User));
        let o = Outcome::now("all green", OutcomeStatus::Success, Actor::Agent, Some(1.0));
        let v = serde_json::to_value(&o).unwrap();
        assert_eq!(
            (v["status"].as_str(), v["by"].as_str(), v["reward"].as_f64()),
            (Some("success"), Some("agent"), Some(1.0))
        );
        assert_eq!(serde_json::from_value::<Outcome>(v).unwrap(), o);
    }

    #[test]
    fn manifest_has_the_papers_field_names() {
        let v = serde_json::to_value(manifest("sp1", Status::Committed)).unwrap();
        for k in [
            "statepoint-id",
            "parent-statepoint-id",
            "branch-id",
            "timestamp",
            "name",
            "state-evidence",
            "local-state",
            "remote-state",
            "status",
        ] {
            assert!(v.get(k).is_some(), "missing {k}");
        }
        assert!(v["local-state"].get("criu-checkpoint-path").is_some());
        assert!(v["local-state"].get("zfs-snapshot").is_some());
        assert_eq!(v["status"], "committed");
    }

    #[test]
    fn exclusive_lock_excludes() {
        let (_scratch, root) = tmp("lock");
        let s = ContainerStore::new(&root, "c");
        let held = s.lock(true).unwrap();
        let f = File::options().write(true).open(s.dir.join("lock")).unwrap();
        assert!(f.try_lock_shared().is_err());
        drop(held);
        // A child another test forks holds a copy of the lock's descriptor until it execs (then
        // CLOEXEC closes it): the lock is free once the last copy is gone.
        let end = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while f.try_lock_shared().is_err() {
            assert!(std::time::Instant::now() < end, "the lock was never released");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

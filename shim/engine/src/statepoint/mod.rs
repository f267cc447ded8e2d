//! Statepoints as operations: [`snapshot`], [`restore`], [`rollback`], [`fork`], and what they
//! share: the context of one operation on one container ([`Ctx`]), recovery from a planarian
//! killed half-way, removal and retention, and the checkpoint directory Podman hands around
//! ([`podman_dir`]).

pub mod async_snapshot;
pub mod fork;
pub(crate) mod forking;
pub(crate) mod journal;
pub(crate) mod podman_dir;
pub mod restore;
pub mod rollback;
pub mod snapshot;
pub mod spares;
pub mod travel;

use crate::config::Config;
use crate::engine::Engine;
use crate::local::{self, criu, freezer::FreezeGuard};
use crate::runtime::{self, lookup, podman, Container, Globals};
use crate::store::{self, ContainerStore, Manifest, Status};
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Runtime(#[from] runtime::Error),
    #[error(transparent)]
    Store(#[from] store::Error),
    #[error(transparent)]
    Chain(#[from] crate::chain::Error),
    #[error(transparent)]
    Local(#[from] local::Error),
    #[error(transparent)]
    Criu(#[from] criu::Error),
    #[error(transparent)]
    Remote(#[from] crate::remote::Error),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Tool(#[from] crate::tools::NotFound),
    #[error(transparent)]
    Io(#[from] sys::IoError),
    #[error(transparent)]
    Fault(#[from] crate::fault::Injected),
    #[error("a statepoint named {0} already exists")]
    NameTaken(String),
    #[error("{0:?} cannot name a statepoint: {1}")]
    BadName(String, &'static str),
    #[error("criu reported success but wrote no images into {}", .0.display())]
    NoImages(PathBuf),
    #[error("the container thawed during the dump: the statepoint would not be consistent")]
    Thawed,
    #[error("the files snapshot failed")]
    FilesPanicked,
    #[error("--pre-dump needs --image-path")]
    PreDumpNeedsImagePath,
    #[error("criu pre-dump failed (log: {}/dump.log)", .0.display())]
    PreDump(PathBuf),
    #[error("{} holds no planarian statepoint (was it checkpointed by another runtime?)", .0.display())]
    NoMarker(PathBuf),
    #[error("{} is malformed", .0.display())]
    BadMarker(PathBuf),
    #[error("unknown statepoint {statepoint} of container {container}")]
    UnknownStatepoint { statepoint: String, container: String },
    #[error("statepoint {0} is not committed")]
    NotCommitted(String),
    #[error("statepoint {statepoint} can no longer be restored: {why}")]
    Unreachable { statepoint: String, why: String },
    #[error("a container with a terminal (-t) is restored only with --console-socket")]
    TerminalNeedsConsole,
    #[error("criu restored the container without its terminal")]
    NoTerminal,
    #[error("statepoint {statepoint} keeps its files on the {then} path but the container now uses the {now} path")]
    BackendChanged { statepoint: String, then: String, now: String },
    #[error("statepoint {statepoint}'s files are missing from {}", path.display())]
    FilesMissing { statepoint: String, path: PathBuf },
    #[error("container {name} is not running (it is {status})")]
    NotRunning { name: String, status: String },
    #[error("another statepoint operation or tool call is running in {0}; try again when it has finished")]
    Busy(String),
    #[error("a container named {0} already exists")]
    ContainerExists(String),
    #[error("{0:?} cannot name a container: a letter or digit first, then letters, digits, _ . or -")]
    BadContainerName(String),
    #[error("a fork into {0} is being made or was interrupted (`planarian fsck --repair` finishes or removes an interrupted one)")]
    ForkUnderWay(String),
    /// A step failed and what undoes it failed too: both are told.
    #[error("{first}; and {undoing} failed: {then}")]
    UndoFailed { first: Box<Error>, undoing: &'static str, then: Box<Error> },
    #[error("rollback failed, the container and its remote state are as they were before: {0}")]
    RolledBack(Box<Error>),
    #[error("rollback failed: the container is as it was before, but its remote state was partly undone: {0}")]
    RemotePartly(Box<Error>),
    #[error("rollback failed: {first}; restoring the previous state failed too: {then} (its statepoint is kept)")]
    NotRolledBack { first: Box<Error>, then: Box<Error> },
    #[error("rollback in place failed after the remote state was compensated: {first}; restoring the statepoint instead failed too: {then} (the next planarian operation on the container finishes the rollback)")]
    NotFinished { first: Box<Error>, then: Box<Error> },
    #[error("{0}")]
    Worker(String),
    /// What goes through Podman, asked of a container a CRI engine runs.
    #[error("{name} is run by a CRI engine (containerd), not by Podman: {what}")]
    NotPodmans { name: String, what: String },
    #[error("fork failed, nothing was created: {0}")]
    ForkFailed(Box<Error>),
    #[error("{} is not a statepoint file: {why}", file.display())]
    NotAStatepointFile { file: PathBuf, why: String },
    #[error("{}: refused, nothing was read from it: {why}", dir.display())]
    Hostile { dir: PathBuf, why: String },
    #[error("the checkpoint names statepoint {statepoint} of container {container}, not this container's: it restores only into that container (export it to move it)")]
    ForeignMarker { statepoint: String, container: String },
    #[error("cannot write {}: {why}", file.display())]
    ExportWrite { file: PathBuf, why: String },
    #[error("import failed, nothing was created: {0}")]
    ImportFailed(Box<Error>),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything one statepoint operation on one running container needs.
pub struct Ctx {
    pub cfg: Config,
    pub crun: PathBuf,
    pub criu: PathBuf,
    pub ctr: Container,
    pub store: ContainerStore,
    pub globals: Globals,
}

impl Ctx {
    /// This context, loaded earlier (before a lock was taken), if its container still runs the
    /// init it had then ([`Container::is_current`]); else the container loaded again.
    pub fn current(self, engine: &Engine) -> Result<Ctx> {
        match self.ctr.is_current(self.globals.root.as_deref()) {
            true => Ok(self),
            false => Ctx::load(engine, &self.ctr.id),
        }
    }

    /// The container crun knows by full ID `id`, with its configuration (annotations applied).
    pub fn load(engine: &Engine, id: &str) -> Result<Ctx> {
        let globals = &engine.globals().for_container(id);
        let crun = engine.crun()?.to_path_buf();
        let criu = engine.criu()?.to_path_buf();
        let ctr = Container::load(&crun, globals, id)?;
        let cfg = ctr.spec.configure(engine.config())?;
        let store = ContainerStore::new(&cfg.store.path, &ctr.id);
        Ok(Ctx { cfg, crun, criu, ctr, store, globals: globals.clone() })
    }

    /// The running container a user names (a name, an ID or a prefix): found without Podman
    /// when containers/storage, crun and the container's conmon tell ([`lookup`]), else through
    /// `podman inspect`, whose answer also makes the clearer error (not running, not
    /// planarian's, no such container).
    ///
    /// A container an interrupted rollback left stopped is first put back (see [`journal`]).
    pub fn running(engine: &Engine, name: &str) -> Result<Ctx> {
        match Ctx::running_now(engine, name) {
            Err(e @ Error::NotRunning { .. }) => match recover_stopped(engine, name)? {
                true => Ctx::running_now(engine, name),
                false => Err(e),
            },
            r => r,
        }
    }

    /// [`Ctx::running`], with the container's exclusive lock taken for a statepoint (what is in
    /// flight in it waited for, and said on stderr meanwhile) and what a killed planarian left
    /// recovered: where a snapshot starts.
    pub fn running_locked(engine: &Engine, name: &str) -> Result<(Ctx, std::fs::File)> {
        let mut ctx = Ctx::running(engine, name)?;
        crate::log::prelude("found");
        let lock = ctx.store.lock_for_statepoint(ctx.cfg.checkpoint.in_flight_wait(), &mut |what| {
            eprintln!("waiting for what is in flight in {name} ({what})")
        })?;
        crate::log::prelude("locked");
        ctx.recover()?;
        crate::log::prelude("recovered");
        Ok((ctx, lock))
    }

    /// crun, as this operation calls it (its path and the container's global flags).
    pub fn crun(&self) -> runtime::crun::Crun<'_> {
        runtime::crun::Crun { bin: &self.crun, globals: &self.globals }
    }

    fn running_now(engine: &Engine, name: &str) -> Result<Ctx> {
        if let Some(id) = lookup::storage_id(name) {
            if let Ok(ctx) = Ctx::load(engine, &id) {
                if let Ok(pid) = ctx.ctr.running_pid() {
                    if lookup::runtime_is_planarian(pid) == Some(true) {
                        return Ok(ctx);
                    }
                }
            }
        }
        if let Some(ctx) = Ctx::of_cri(engine, name) {
            return Ok(ctx);
        }
        let pc = podman::planarian_container(name)?;
        if !matches!(pc.status.as_str(), "running" | "paused") {
            // (stopped by planarian because its memory, restored on demand, was lost: said so)
            let store = ContainerStore::new(&engine.config().store.path, &pc.id);
            let status = match crate::local::lazy::lost(&store) {
                Some(why) => format!("{}: its memory was being restored on demand and was lost: {why}", pc.status),
                None => pc.status,
            };
            return Err(Error::NotRunning { name: name.to_string(), status });
        }
        Ctx::load(engine, &pc.id)
    }

    /// A running container a CRI engine runs through planarian, which no Podman knows
    /// (containerd's, named by its full ID): with the `--root` its runtime was given.
    fn of_cri(engine: &Engine, name: &str) -> Option<Ctx> {
        let root = lookup::cri_root(name)?;
        let ctx =
            Ctx::load(&engine.with_globals(Globals { root: Some(root), ..engine.globals().clone() }), name).ok()?;
        let pid = ctx.ctr.running_pid().ok()?;
        (lookup::runtime_is_planarian(pid) == Some(true)).then_some(ctx)
    }

    /// Undoes what a crashed planarian may have left: a rollback half-way (finished or undone,
    /// [`journal`]), a cgroup it froze (and CRIU's network lock, which a CRIU killed with it
    /// leaves), pending statepoints. Call with the exclusive lock held; an interrupted rollback
    /// that cannot be recovered now is an error (nothing may build on a sandbox half rolled
    /// back).
    pub fn recover(&mut self) -> Result<()> {
        if journal::recover(Ok(&self.crun), &self.globals, &self.cfg, &self.store, &self.ctr.id)?.is_some() {
            // (the container may run new processes now)
            self.ctr = Container::load(&self.crun, &self.globals, &self.ctr.id)?;
        }
        let marker = self.store.dir.join(local::freezer::MARKER);
        if marker.exists() {
            if let Ok(pid) = self.ctr.running_pid() {
                criu::remove_stale_network_lock(pid);
            }
            FreezeGuard::recover(&marker);
        }
        discard_stale(&self.cfg, &self.store);
        finish_compensation(&self.store, &self.ctr.id);
        Ok(())
    }
}

/// Puts back a container an interrupted rollback left stopped, under its exclusive lock:
/// whether there was one to put back.
fn recover_stopped(engine: &Engine, name: &str) -> Result<bool> {
    let cfg = engine.config();
    let Ok(store) = store_of(cfg, name) else { return Ok(false) };
    if !journal::interrupted(&store) {
        return Ok(false);
    }
    let _lock = store.lock(true)?;
    Ok(journal::recover(engine.crun(), engine.globals(), cfg, &store, &store.container_id())?.is_some())
}

/// A rollback whose planarian was killed after it restored the sandbox, before its
/// compensation ended: the compensation is finished now, so sandbox and services are both at
/// the target (said on stderr; a compensation that still fails is said too, and tried again
/// by the next operation).
pub fn finish_compensation(store: &ContainerStore, id: &str) {
    match crate::remote::hooks::finish_interrupted(&store.dir, id) {
        Ok(Some(target)) => {
            said_compensated(&target);
            if let Ok(m) = store.find(&target) {
                crate::context::mark_unreachable(store, &m);
            }
        }
        Ok(None) => {}
        Err(e) => eprintln!(
            "planarian: an interrupted rollback's compensation still fails (tried again by the next operation): {e}"
        ),
    }
}

fn said_compensated(target: &str) {
    eprintln!("planarian: finished the compensation of an interrupted rollback to {target}: the remote state is at {target}, like the sandbox");
}

/// The planarian container a user names (a name, an ID or a prefix), as `podman inspect`
/// describes it. One that runs (not frozen) is found without Podman when containers/storage,
/// crun and its conmon tell ([`lookup`]): Podman's inspect costs half a second and more, on
/// the path of every rollback and fork. Anything else — frozen (paused, or inside a snapshot),
/// stopped, not found — is asked of Podman, whose answer also makes the clearer error.
pub fn planarian_container(engine: &Engine, name: &str) -> Result<podman::PodmanContainer> {
    planarian_container_loaded(engine, name).map(|(pc, _)| pc)
}

/// [`planarian_container`], with the context it loaded when it found the container without
/// Podman (for an operation that needs it next: see [`Ctx::current`]).
pub fn planarian_container_loaded(engine: &Engine, name: &str) -> Result<(podman::PodmanContainer, Option<Ctx>)> {
    let found = || -> Option<(podman::PodmanContainer, Option<Ctx>)> {
        let e = lookup::storage_entry(name)?;
        let ctx = Ctx::load(engine, &e.id).ok()?;
        let pid = ctx.ctr.running_pid().ok()?;
        if lookup::runtime_is_planarian(pid) != Some(true) || local::freezer::Freezer::of_pid(pid).ok()?.is_frozen() {
            return None;
        }
        Some((running(&ctx, e.name, e.upperdir, false), Some(ctx)))
    };
    // A CRI engine's (containerd's) container, running and not frozen.
    let cri = || -> Option<podman::PodmanContainer> {
        let ctx = Ctx::of_cri(engine, name)?;
        let pid = ctx.ctr.running_pid().ok()?;
        if local::freezer::Freezer::of_pid(pid).ok()?.is_frozen() {
            return None;
        }
        let upperdir = runtime::container::overlay_upperdir_of(pid).ok().flatten();
        let name = ctx.ctr.id.clone();
        Some(running(&ctx, name, upperdir, true))
    };
    match found().or_else(|| cri().map(|pc| (pc, None))) {
        Some(found) => Ok(found),
        None => Ok((podman::planarian_container(name)?, None)),
    }
}

/// A running planarian container found without Podman, as `podman inspect` would describe it.
fn running(ctx: &Ctx, name: String, upperdir: Option<std::path::PathBuf>, cri: bool) -> podman::PodmanContainer {
    podman::PodmanContainer {
        id: ctx.ctr.id.clone(),
        name,
        status: "running".into(),
        runtime: "planarian".into(),
        bundle: ctx.ctr.bundle.clone(),
        upperdir,
        annotations: ctx
            .ctr
            .spec
            .annotations
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect(),
        cri,
    }
}

/// The statepoint store of the container a user names. A container with statepoints is one
/// planarian runs, so one found by containers/storage with a store of its own needs no question
/// to Podman.
pub fn store_of(cfg: &Config, name: &str) -> Result<ContainerStore> {
    // A full ID with a store: also a container Podman does not know (one CRI-O runs).
    if name.len() == 64 && name.bytes().all(|b| b.is_ascii_hexdigit()) {
        let store = ContainerStore::new(&cfg.store.path, name);
        if store.dir.is_dir() {
            return Ok(store);
        }
    }
    if let Some(id) = lookup::storage_id(name) {
        let store = ContainerStore::new(&cfg.store.path, &id);
        if store.dir.is_dir() {
            return Ok(store);
        }
    }
    let pc = podman::planarian_container(name)?;
    Ok(ContainerStore::new(&cfg.store.path, &pc.id))
}

/// Removes the statepoints a crashed planarian left pending, with their parts. Call with the
/// exclusive lock held.
pub fn discard_stale(cfg: &Config, store: &ContainerStore) {
    let (pending, orphans) = store.stale();
    for m in pending {
        if let Some(snap) = &m.local_state.zfs_snapshot {
            let _ = local::zfs::destroy_snapshot(cfg, store, snap);
        }
        let _ = std::fs::remove_dir_all(store.statepoint_dir(&m.statepoint_id));
    }
    for dir in orphans {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Removes a statepoint: discarded in the registry first (a crash half-way leaves no committed
/// statepoint without its parts), then its files; its memory images stay while a later dump of
/// the chain links to them ([`crate::chain::collect`]). Call with the exclusive lock held.
pub fn remove(cfg: &Config, store: &ContainerStore, id: &str) -> Result<()> {
    let m = store.mark_discarded(id)?;
    free(cfg, store, &m)
}

/// What statepoint `m`, discarded, still holds: its copy of the files, its ZFS snapshot, its
/// images (once no chain needs them).
pub fn free(cfg: &Config, store: &ContainerStore, m: &Manifest) -> Result<()> {
    let id = &m.statepoint_id;
    let dir = store.statepoint_dir(id);
    if let Some(copy) = &m.local_state.rootfs_copy_path {
        let p = dir.join(copy);
        if p.exists() {
            sys::Context::at(std::fs::remove_dir_all(&p), "remove", &p)?;
        }
        let _ = std::fs::remove_file(dir.join(local::copy::INDEX));
    }
    if let Some(snap) = &m.local_state.zfs_snapshot {
        local::zfs::destroy_snapshot(cfg, store, snap)?;
    }
    crate::chain::collect(store);
    Ok(())
}

/// Keeps the newest `store.retention` committed statepoints (and the head), removing the oldest.
pub fn enforce_retention(cfg: &Config, store: &ContainerStore) {
    let keep = cfg.store.retention as usize;
    if keep == 0 {
        return;
    }
    // (in full: a statepoint counted here must be one `remove` can read)
    let committed = store.committed();
    let head = store.head();
    let excess = committed.len().saturating_sub(keep);
    for m in committed.iter().filter(|m| Some(&m.statepoint_id) != head.as_ref()).take(excess) {
        let _ = remove(cfg, store, &m.statepoint_id);
    }
}

/// Names, descriptions and outcomes of a committed statepoint, changed under the exclusive lock;
/// the captured state is never touched.
/// Whether `name` can name a statepoint: printable, without `/`, not `.` or `..`, at most 128
/// bytes, and not of an id's shape (`sp` and digits), which it would hide.
pub fn check_name(name: &str) -> Result<()> {
    let bad = |why| Err(Error::BadName(name.to_string(), why));
    if name.len() > 128 {
        return bad("longer than 128 bytes");
    }
    if name.contains('/') || name == "." || name == ".." {
        return bad("a name is not a path");
    }
    if name.chars().any(char::is_control) {
        return bad("it holds a control character");
    }
    if crate::store::is_id(name) {
        return bad("that is the shape of a statepoint id");
    }
    Ok(())
}

/// Whether `name` can name a new container: Podman's rule (a letter or digit, then letters,
/// digits, `_`, `.` or `-`), checked before it is used for anything (a fork's record is a file
/// of that name).
pub fn check_container_name(name: &str) -> Result<()> {
    let mut b = name.bytes();
    let first = b.next().is_some_and(|c| c.is_ascii_alphanumeric());
    if first && name.len() <= 253 && b.all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-')) {
        return Ok(());
    }
    Err(Error::BadContainerName(name.to_string()))
}

pub fn annotate(
    store: &ContainerStore,
    key: &str,
    name: Option<&str>,
    description: Option<&str>,
    outcomes: Vec<store::Outcome>,
) -> Result<Manifest> {
    let _lock = store.lock(true)?;
    let mut m = store.find(key)?;
    if let Some(n) = name {
        if !n.is_empty() {
            check_name(n)?;
        }
        if store.find(n).is_ok_and(|o| o.statepoint_id != m.statepoint_id) {
            return Err(Error::NameTaken(n.to_string()));
        }
        m.name = Some(n.to_string()).filter(|n| !n.is_empty());
    }
    if let Some(d) = description {
        m.state_evidence.state_description = d.to_string();
    }
    m.state_evidence.prior_outcomes.extend(outcomes);
    store.write_manifest(&m)?;
    Ok(m)
}

/// `sp3 (deps-installed)`, or just `sp3`.
pub fn describe(m: &Manifest) -> String {
    match &m.name {
        Some(n) => format!("{} ({n})", m.statepoint_id),
        None => m.statepoint_id.clone(),
    }
}

/// The first 12 characters of an ID, as Podman shows them.
pub fn short(id: &str) -> &str {
    &id[..id.len().min(12)]
}

/// Whether `m` is committed, or the error that says it is not.
fn committed(m: Manifest) -> Result<Manifest> {
    match m.status {
        Status::Committed => Ok(m),
        _ => Err(Error::NotCommitted(m.statepoint_id)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_container_name_is_podmans_never_a_path() {
        for ok in ["agent-b", "a", "x.1_2-3", "0abc"] {
            assert!(check_container_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "/etc/passwd", "../lock", "a/b", ".x", "-x", "a b", "a\nb", "é"] {
            assert!(matches!(check_container_name(bad), Err(Error::BadContainerName(_))), "{bad:?}");
        }
    }

    #[test]
    fn a_name_is_a_label_never_a_path_nor_an_id() {
        for ok in ["tests-pass", "before refactor", "v1.2", "ünïcode", "sp", "spare", "sp1a", &"x".repeat(128)] {
            assert!(check_name(ok).is_ok(), "{ok}");
        }
        for (bad, why) in [
            ("../other", "path"),
            ("a/b", "path"),
            ("..", "path"),
            (".", "path"),
            ("sp12", "id"),
            ("line\nbreak", "control"),
            (&"x".repeat(129) as &str, "128"),
        ] {
            let e = check_name(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn waiting_for_a_key_that_is_a_path_reads_nothing_outside_the_store() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join("key");
        let store = ContainerStore::new(&dir, "c");
        std::fs::create_dir_all(store.dir.join("async")).unwrap();
        // A committed-looking record outside the container's records.
        let outside = dir.join("containers/evil.json");
        std::fs::write(&outside, r#"{"statepoint":"sp1","status":"committed"}"#).unwrap();
        assert!(async_snapshot::wait(&store, "../../evil").is_err());
        assert!(store.find("../../evil").is_err());
    }
}

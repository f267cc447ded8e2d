//! A fork under way, written down in its source's store, so that a planarian killed in the
//! middle of a fork (or of making a spare, or of handing one out) leaves nothing half-made: the
//! next fork of that source, or `planarian fsck --repair`, finishes it or removes what it made.
//!
//! `forking/NAME` (NAME: the new container's) is made before Podman is asked for anything and
//! locked (`flock`) by the planarian making the fork, for as long as it runs; a record whose lock
//! can be had is one whose planarian died. It says what was being made:
//!
//! | kind | what recovery finds | what it does |
//! |---|---|---|
//! | a fork | the new container running (its restore ended) | finished: it runs, its restore context written |
//! | a fork | anything else (none, created, stopped, half-restored) | undone: container, store, dataset and database branch removed |
//! | a spare being made | registered already | finished: a spare like any other |
//! | a spare being made | not registered | undone (a spare not registered is nobody's) |
//! | a spare claimed, its hand-out not begun | the spare | undone: registered again |
//! | a spare being handed out | the spare's container | finished: renamed, thawed |
//!
//! A record is made whole under a name of its own and linked into place (a name already there
//! is a fork under way or interrupted: refused), so a record is never seen half-written, nor
//! locked by anyone but its maker. A record that does not know its container's ID yet (killed
//! during `podman container clone`) adopts only a container of its name that has never run,
//! made within five minutes after the record, and that no live record of another source claims.
//!
//! Before deciding, recovery waits for what the killed planarian started and what outlived it
//! (a `podman container clone`, `init` or `restore` naming the new container, a CRIU with its
//! store open): a clone or a restore left running would otherwise end after the decision.

use super::{Error, Result};
use crate::config::Config;
use crate::runtime::lookup;
use crate::runtime::podman::{self, PodmanContainer};
use crate::store::ContainerStore;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;
use sys::Context;

const DIR: &str = "forking";

/// What is being made.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// A fork made on the spot.
    #[default]
    Fork,
    /// A spare (a fork held frozen, registered when made).
    Spare,
    /// A registered spare, claimed for the fork, its hand-out not begun.
    Claimed,
    /// A registered spare, claimed, being renamed and thawed.
    HandOut,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default)]
struct Entry {
    kind: Kind,
    /// The source's statepoint.
    statepoint: String,
    /// The new container's ID, once Podman made it (a spare's, for a hand-out).
    id: Option<String>,
}

/// The record of a fork under way; removed when dropped (the fork ended in this process, made
/// or undone).
pub struct Record {
    path: PathBuf,
    file: File,
    entry: Entry,
}

impl Record {
    /// Written before anything of fork `name` of statepoint `sp` is made (`id`: the spare it is
    /// to hand out, for [`Kind::Claimed`]). Refused for a name that is not a container's, and
    /// while a record of that name is there (a fork under way, or one interrupted and not yet
    /// recovered).
    pub fn begin(store: &ContainerStore, name: &str, sp: &str, kind: Kind, id: Option<&str>) -> Result<Record> {
        super::check_container_name(name)?;
        let dir = store.dir.join(DIR);
        std::fs::create_dir_all(&dir).at("create", &dir)?;
        let path = dir.join(name);
        // Made whole under a name of its own, locked, then linked into place: never seen
        // half-written, never locked by another first.
        let tmp = dir.join(format!(".{name}.{}", std::process::id()));
        let file = File::options().create(true).truncate(true).write(true).open(&tmp).at("open", &tmp)?;
        file.lock().at("lock", &tmp)?;
        let mut r = Record {
            path: tmp.clone(),
            file,
            entry: Entry { kind, statepoint: sp.to_string(), id: id.map(String::from) },
        };
        let linked = r.write().and_then(|()| match std::fs::hard_link(&tmp, &path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(Error::ForkUnderWay(name.to_string())),
            Err(e) => Err(sys::IoError::new("link", path.clone(), e).into()),
        });
        let _ = std::fs::remove_file(&tmp);
        linked?;
        r.path = path;
        Ok(r)
    }

    /// Now making `kind`, of the container whose ID is `id`.
    pub fn set(&mut self, kind: Kind, id: &str) -> Result<()> {
        self.entry.kind = kind;
        self.entry.id = Some(id.to_string());
        self.write()
    }

    /// The spare it was to hand out could not be: the fork is made on the spot instead.
    pub fn fork_anew(&mut self) -> Result<()> {
        self.entry.kind = Kind::Fork;
        self.entry.id = None;
        self.write()
    }

    /// The new container's name.
    pub fn name(&self) -> &str {
        self.path.file_name().and_then(|n| n.to_str()).unwrap_or_default()
    }

    /// Podman made the new container: its ID is `id`.
    pub fn made(&mut self, id: &str) -> Result<()> {
        self.set(self.entry.kind.clone(), id)
    }

    /// (in place: the lock is the file's; a rename would put an unlocked one in its place. The
    /// text first, then the length: a reader of a record cut short here still finds the whole
    /// old or new text first, the rest ignored)
    fn write(&mut self) -> Result<()> {
        let text = serde_json::to_vec(&self.entry).expect("a fork record serialises");
        let at = |e| sys::IoError::new("write", self.path.clone(), e);
        self.file.write_all_at(&text, 0).map_err(at)?;
        self.file.set_len(text.len() as u64).map_err(at)?;
        self.file.sync_data().map_err(at)?;
        Ok(())
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        // (removed while still locked: a recovery that opened it before waits for the lock, then
        // sees the name no longer leads to it)
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A record whose planarian died, locked by the caller until dropped.
pub struct Interrupted {
    pub name: String,
    pub statepoint: String,
    pub(super) kind: Kind,
    pub(super) id: Option<String>,
    pub(super) path: PathBuf,
    _file: File,
}

/// The forks of `store`'s container that a killed planarian left, each locked for its caller
/// (another recovery's, or a live fork's, are not listed).
pub fn interrupted(store: &ContainerStore) -> Vec<Interrupted> {
    let dir = store.dir.join(DIR);
    let Ok(rd) = std::fs::read_dir(&dir) else { return Vec::new() };
    let mut out: Vec<Interrupted> = rd
        .flatten()
        .filter_map(|e| {
            let path = e.path();
            let name = e.file_name().to_str()?.to_string();
            let file = File::options().read(true).write(true).open(&path).ok()?;
            file.try_lock().ok()?;
            if name.starts_with('.') {
                // (a record its maker died before linking into place: nothing was made)
                let _ = std::fs::remove_file(&path);
                return None;
            }
            // Still the file at that name (not one a fork that ended removed meanwhile).
            let (held, named) = (file.metadata().ok()?, std::fs::metadata(&path).ok()?);
            if (held.dev(), held.ino()) != (named.dev(), named.ino()) {
                return None;
            }
            // (the first JSON value: what follows is what a longer text before it left)
            let text = std::fs::read(&path).ok()?;
            let entry: Entry =
                serde_json::Deserializer::from_slice(&text).into_iter().next().and_then(|e| e.ok()).unwrap_or_default();
            Some(Interrupted { name, statepoint: entry.statepoint, kind: entry.kind, id: entry.id, path, _file: file })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// The container the record speaks of: by its ID, or (killed before it was known, during the
/// clone) the container of the record's name that never ran, made within five minutes after
/// the record, and that no live record of another source claims.
pub(super) fn found(cfg: &Config, r: &Interrupted) -> Option<PodmanContainer> {
    if let Some(id) = &r.id {
        return podman::inspect(id).ok();
    }
    let c = podman::inspect(&r.name).ok()?;
    if !matches!(c.status.as_str(), "created" | "configured") || claimed_elsewhere(cfg, &r.path, &r.name) {
        return None;
    }
    let record = std::fs::metadata(&r.path).ok()?.modified().ok()?;
    let made = std::fs::metadata(&c.bundle).ok().and_then(|m| m.created().or_else(|_| m.modified()).ok())?;
    let after = made.duration_since(record).ok()?;
    (after <= Duration::from_secs(300)).then_some(c)
}

/// Whether a live planarian's record of another container's store is making fork `name`.
fn claimed_elsewhere(cfg: &Config, ours: &Path, name: &str) -> bool {
    let Ok(rd) = std::fs::read_dir(cfg.store.path.join("containers")) else { return false };
    rd.flatten().map(|e| e.path().join(DIR).join(name)).filter(|p| p != ours).any(|p| {
        File::options()
            .read(true)
            .open(&p)
            .is_ok_and(|f| matches!(f.try_lock(), Err(std::fs::TryLockError::WouldBlock)))
    })
}

/// Waits (at most `max`) for what the killed planarian started against the new container: a
/// Podman command of a fork's (clone, init, stop, rename, restore, rm) naming it, a CRIU with
/// its store open.
pub(super) fn wait_for_orphans(cfg: &Config, r: &Interrupted, max: Duration) {
    let mut names = vec![r.name.clone()];
    names.extend(r.id.clone());
    let stores: Vec<PathBuf> = r.id.iter().map(|id| ContainerStore::new(&cfg.store.path, id).dir).collect();
    let verbs: [&[u8]; 6] = [b"clone", b"init", b"stop", b"rename", b"restore", b"rm"];
    let forks =
        |args: &[&[u8]]| names.iter().any(|n| args.contains(&n.as_bytes())) && verbs.iter().any(|v| args.contains(v));
    let end = std::time::Instant::now() + max;
    while super::journal::orphans(&stores, &forks) && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether a container already has name `n`: Podman is asked only when containers/storage's
/// records cannot be read.
pub(super) fn taken(n: &str) -> bool {
    lookup::name_taken(n).unwrap_or_else(|| podman::inspect(n).is_ok())
}

/// The record of a fork (`kind`) of statepoint `sp` under the first `STEM-K` (K = 1, 2, …) that
/// no container has, `chosen` has not, and no other fork under way is taking.
pub(super) fn free_record(
    store: &ContainerStore,
    stem: &str,
    sp: &str,
    kind: Kind,
    chosen: &dyn Fn(&str) -> bool,
) -> Result<Record> {
    for k in 1.. {
        let n = format!("{stem}-{k}");
        if chosen(&n) || taken(&n) {
            continue;
        }
        match Record::begin(store, &n, sp, kind.clone(), None) {
            Err(Error::ForkUnderWay(_)) => continue,
            r => return r,
        }
    }
    unreachable!("some K is free")
}

/// Removes fork `name` of `src` and everything it was given: the container, its store, its
/// dataset, its database.
pub(super) fn discard(cfg: &Config, src: &PodmanContainer, name: &str) {
    match podman::inspect(name) {
        Ok(c) => discard_id(cfg, src, &c.id),
        Err(_) => drop(podman::remove(name)),
    }
}

/// [`discard`], of the fork whose container ID is (or was) `id`.
pub(super) fn discard_id(cfg: &Config, src: &PodmanContainer, id: &str) {
    let _ = podman::remove(id);
    let store = ContainerStore::new(&cfg.store.path, id);
    let _ = crate::local::zfs::remove_container(cfg, &store);
    let _ = std::fs::remove_dir_all(store.dir);
    unbranch(cfg, src, id);
}

/// Drops the database a failed fork `new_id` may have been given (nothing when it has none).
fn unbranch(cfg: &Config, src: &PodmanContainer, new_id: &str) {
    let Ok(src_cfg) = src_config(cfg, src) else { return };
    if let (Ok(Some((_, svc))), Ok(proxy)) =
        (crate::remote::sidecar::service(&src_cfg), crate::remote::sidecar::proxy_path(&src_cfg))
    {
        if src_cfg.mcp.disabled.is_none() && crate::remote::sidecar::can_branch(svc) {
            let _ = crate::remote::hooks::unbranch(&proxy, &src.id, new_id);
        }
    }
}

/// The configuration the source container runs with (its `io.planarian.*` annotations applied).
pub(super) fn src_config(cfg: &Config, src: &PodmanContainer) -> Result<Config> {
    let a = src.annotations.iter().filter_map(|(k, v)| Some((k.as_str(), v.as_str()?)));
    Ok(cfg.with_annotations_of(a, None)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`interrupted`] once it finds something, within 30 s: a record's lock lives on in a child
    /// another test forked, until that child execs (it holds a copy of every descriptor).
    fn interrupted_eventually(store: &ContainerStore) -> Vec<Interrupted> {
        let end = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let found = interrupted(store);
            if !found.is_empty() || std::time::Instant::now() > end {
                return found;
            }
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_record_is_its_makers_until_it_ends_and_a_dead_makers_is_found() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join("forking");
        let store = ContainerStore::new(&dir, "c");
        std::fs::create_dir_all(&store.dir).unwrap();
        for bad in ["/etc/passwd", "../lock", "a/b", ".hidden"] {
            assert!(
                matches!(Record::begin(&store, bad, "sp2", Kind::Fork, None), Err(Error::BadContainerName(_))),
                "{bad}"
            );
        }
        let mut r = Record::begin(&store, "f1", "sp2", Kind::Fork, None).unwrap();
        assert!(interrupted(&store).is_empty(), "a live fork's record is not an interrupted one");
        assert!(
            matches!(Record::begin(&store, "f1", "sp2", Kind::Fork, None), Err(Error::ForkUnderWay(_))),
            "a second fork of the same name while the first runs"
        );
        r.set(Kind::Spare, "abc").unwrap();
        let path = store.dir.join(DIR).join("f1");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"spare\"") && text.contains("abc"), "{text}");
        // A shorter text over a longer one: the reader takes the first.
        r.set(Kind::HandOut, "x").unwrap();
        // As a killed maker leaves it: the file, unlocked (its lock gone with it).
        std::mem::forget(r);
        let copy = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, [&copy[..], b"\"}trailing"].concat()).unwrap();
        let found = interrupted_eventually(&store);
        assert_eq!(found.len(), 1);
        assert_eq!((found[0].name.as_str(), found[0].statepoint.as_str()), ("f1", "sp2"));
        assert_eq!((found[0].kind.clone(), found[0].id.as_deref()), (Kind::HandOut, Some("x")));
        assert!(interrupted(&store).is_empty(), "one recovery at a time: it is locked for the first");
        assert!(matches!(Record::begin(&store, "f1", "sp2", Kind::Fork, None), Err(Error::ForkUnderWay(_))));
        drop(found);
        // A record cut short names a fork made on the spot, known by its name.
        std::fs::write(&path, b"{\"kind\":").unwrap();
        let found = interrupted_eventually(&store);
        assert_eq!((found[0].kind.clone(), found[0].id.as_deref()), (Kind::Fork, None));
        drop(found);
        std::fs::remove_file(&path).unwrap();
        // A maker that died before linking its record into place leaves only its own file.
        let tmp = store.dir.join(DIR).join(".f3.1");
        std::fs::write(&tmp, b"{}").unwrap();
        assert!(interrupted(&store).is_empty() && !tmp.exists(), "removed, nothing to recover");
        let r = Record::begin(&store, "f2", "sp2", Kind::Claimed, Some("s1")).unwrap();
        assert_eq!(r.name(), "f2");
        drop(r);
        let left: Vec<_> = std::fs::read_dir(store.dir.join(DIR)).unwrap().flatten().map(|e| e.file_name()).collect();
        assert!(left.is_empty(), "removed when the fork ends: {left:?}");
    }
}

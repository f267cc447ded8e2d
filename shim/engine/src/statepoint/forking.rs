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
//! | a spare being made | anything | undone (a spare not registered is nobody's) |
//! | a spare being handed out | the spare's container | finished: renamed, thawed |
//!
//! Before deciding, recovery waits for what the killed planarian started and what outlived it
//! (a `podman container clone`, `init` or `restore` naming the new container, a CRIU with its
//! store open): a clone or a restore left running would otherwise end after the decision.

use super::{Error, Result};
use crate::config::Config;
use crate::runtime::podman::{self, PodmanContainer};
use crate::runtime::Globals;
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
    /// Written before anything of fork `name` of statepoint `sp` is made. Refused while another
    /// planarian makes a fork of the same name.
    pub fn begin(store: &ContainerStore, name: &str, sp: &str, kind: Kind) -> Result<Record> {
        let dir = store.dir.join(DIR);
        std::fs::create_dir_all(&dir).at("create", &dir)?;
        let path = dir.join(name);
        let file = File::options().create(true).truncate(false).write(true).open(&path).at("open", &path)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => return Err(Error::ContainerExists(name.to_string())),
            Err(std::fs::TryLockError::Error(e)) => return Err(sys::IoError::new("lock", path, e).into()),
        }
        let mut r = Record { path, file, entry: Entry { kind, statepoint: sp.to_string(), id: None } };
        r.write()?;
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

    /// (in place: the lock is the file's; a rename would put an unlocked one in its place)
    fn write(&mut self) -> Result<()> {
        let text = serde_json::to_vec(&self.entry).expect("a fork record serialises");
        let at = |e| sys::IoError::new("write", self.path.clone(), e);
        self.file.set_len(0).map_err(at)?;
        self.file.write_all_at(&text, 0).map_err(at)?;
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
    kind: Kind,
    id: Option<String>,
    path: PathBuf,
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
            // Still the file at that name (not one a fork that ended removed meanwhile).
            let (held, named) = (file.metadata().ok()?, std::fs::metadata(&path).ok()?);
            if (held.dev(), held.ino()) != (named.dev(), named.ino()) {
                return None;
            }
            // (a record cut short by the kill says only its name: a fork made on the spot)
            let entry: Entry = serde_json::from_slice(&std::fs::read(&path).ok()?).unwrap_or_default();
            Some(Interrupted { name, statepoint: entry.statepoint, kind: entry.kind, id: entry.id, path, _file: file })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// How recovery left an interrupted fork.
#[derive(Debug, PartialEq, Eq)]
pub enum Recovered {
    /// It runs.
    Finished(String),
    /// Nothing of it is left.
    Undone(String),
}

impl std::fmt::Display for Recovered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Recovered::Finished(n) => write!(f, "an interrupted fork into {n} was finished: it runs"),
            Recovered::Undone(n) => write!(f, "an interrupted fork into {n} was undone: nothing of it is left"),
        }
    }
}

/// Finishes or undoes every fork of `src` a killed planarian left (see the module's table),
/// saying which on stderr. Calls Podman: never from a verb Podman runs.
pub fn recover(globals: &Globals, cfg: &Config, src: &PodmanContainer, store: &ContainerStore) -> Vec<Recovered> {
    let mut out = Vec::new();
    for r in interrupted(store) {
        let done = resolve(globals, cfg, src, store, &r);
        let _ = std::fs::remove_file(&r.path);
        eprintln!("planarian: {done}");
        out.push(done);
    }
    out
}

fn resolve(
    globals: &Globals,
    cfg: &Config,
    src: &PodmanContainer,
    store: &ContainerStore,
    r: &Interrupted,
) -> Recovered {
    wait_for_orphans(cfg, r, Duration::from_secs(300));
    let undone = Recovered::Undone(r.name.clone());
    let Some(new) = found(r) else {
        // (Podman made none; what the record knew of is removed all the same)
        if let Some(id) = &r.id {
            super::fork::discard_id(cfg, src, id);
        }
        return undone;
    };
    match r.kind {
        Kind::Fork if new.status == "running" => {
            let new_store = ContainerStore::new(&cfg.store.path, &new.id);
            if crate::context::RestoreContext::last(&new_store).is_none() {
                if let Ok(target) = store.find(&r.statepoint) {
                    let _ = super::fork::context(src, &target, &r.name).save(&new_store);
                }
            }
            Recovered::Finished(r.name.clone())
        }
        Kind::HandOut => match super::spares::finish_hand_out(globals, cfg, src, &new, &r.name) {
            Ok(()) => Recovered::Finished(r.name.clone()),
            Err(_) => undone,
        },
        Kind::Spare => {
            super::spares::forget(store, &r.statepoint, &new.id);
            super::spares::remove_id(cfg, src, &new.id);
            undone
        }
        Kind::Fork => {
            super::fork::discard_id(cfg, src, &new.id);
            undone
        }
    }
}

/// The container the record speaks of: by its ID, or (killed before it was known) the
/// container of the record's name made after the record was.
fn found(r: &Interrupted) -> Option<PodmanContainer> {
    if let Some(id) = &r.id {
        return podman::inspect(id).ok();
    }
    let c = podman::inspect(&r.name).ok()?;
    let born = |p: &Path| std::fs::metadata(p).ok()?.created().ok();
    match (born(&r.path), born(&c.bundle)) {
        (Some(record), Some(made)) if made < record => None,
        _ => Some(c),
    }
}

/// Waits (at most `max`) for what the killed planarian started against the new container: a
/// Podman command naming it (its clone, init, stop, rename or restore), a CRIU with its store
/// open.
fn wait_for_orphans(cfg: &Config, r: &Interrupted, max: Duration) {
    let mut names = vec![r.name.clone()];
    names.extend(r.id.clone());
    let stores: Vec<PathBuf> = r.id.iter().map(|id| ContainerStore::new(&cfg.store.path, id).dir).collect();
    let end = std::time::Instant::now() + max;
    while super::journal::orphans(&stores, &|args: &[&[u8]]| names.iter().any(|n| args.contains(&n.as_bytes())))
        && std::time::Instant::now() < end
    {
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_its_makers_until_it_ends_and_a_dead_makers_is_found() {
        let dir = std::env::temp_dir().join(format!("planarian-forking-{}", std::process::id()));
        let store = ContainerStore::new(&dir, "c");
        std::fs::create_dir_all(&store.dir).unwrap();
        let mut r = Record::begin(&store, "f1", "sp2", Kind::Fork).unwrap();
        assert!(interrupted(&store).is_empty(), "a live fork's record is not an interrupted one");
        assert!(
            matches!(Record::begin(&store, "f1", "sp2", Kind::Fork), Err(Error::ContainerExists(_))),
            "a second fork of the same name while the first runs"
        );
        r.set(Kind::Spare, "abc").unwrap();
        let text = std::fs::read_to_string(store.dir.join(DIR).join("f1")).unwrap();
        assert!(text.contains("\"spare\"") && text.contains("abc"), "{text}");
        // As a killed maker leaves it: the file, unlocked.
        std::mem::forget(r);
        let path = store.dir.join(DIR).join("f1");
        let copy = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, copy).unwrap();
        let found = interrupted(&store);
        assert_eq!(found.len(), 1);
        assert_eq!((found[0].name.as_str(), found[0].statepoint.as_str()), ("f1", "sp2"));
        assert_eq!((found[0].kind.clone(), found[0].id.as_deref()), (Kind::Spare, Some("abc")));
        assert!(interrupted(&store).is_empty(), "one recovery at a time: it is locked for the first");
        drop(found);
        // A record cut short by the kill is a fork made on the spot, known by its name.
        std::fs::write(&path, b"{\"kind\":").unwrap();
        let found = interrupted(&store);
        assert_eq!((found[0].kind.clone(), found[0].id.as_deref()), (Kind::Fork, None));
        drop(found);
        std::fs::remove_file(&path).unwrap();
        let r = Record::begin(&store, "f2", "sp2", Kind::Fork).unwrap();
        drop(r);
        assert!(!store.dir.join(DIR).join("f2").exists(), "removed when the fork ends");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! Spare forks (FAST-ROLLBACK's direction 3): forks of a statepoint made ahead of time, restored
//! and then held frozen, so that a later fork of that statepoint is a thaw (and a rename)
//! instead of a clone, an init and a CRIU restore.
//!
//! `planarian spare CTR SP --count N` keeps N of them. Each is an ordinary fork (its own
//! container, store, files and database branch), named `CTR-spare-SP-K`, frozen by planarian
//! through its cgroup's freezer as a snapshot freezes a sandbox (a marker in its store,
//! `spare-frozen`, names the cgroup) and registered in CTR's store under `spares/SP/ID`. Podman,
//! conmon and the network stay in charge of it; `podman ps` shows it running, since to Podman it
//! is (`podman pause` would make handing it out a Podman call: an unpause costs more than a
//! snapshot). `planarian fork CTR SP --name NEW` claims a registered spare (removing its
//! registration, so that two forks never get the same one), renames it NEW and thaws it; without
//! `--name` it keeps its own name and is only thawed. When there is none, or the one claimed is
//! unusable, the fork is made as before.
//!
//! A spare runs for the moment between its restore and its freeze: a process that acts on the
//! world outside the sandbox the moment it resumes does so then, not when the spare is handed
//! out. Spares are containers of their own: `--count 0` removes a statepoint's spares, and so does
//! `planarian statepoint rm`; removing CTR, or its retention removing the statepoint, leaves them
//! to `podman rm -f` (`podman stop` waits for its timeout: a frozen process does not act on
//! SIGTERM).

use super::forking::{self, Kind, Record};
use super::{Error, Result};
use crate::config::Config;
use crate::context::RestoreContext;
use crate::engine::Engine;
use crate::local::freezer::Freezer;
use crate::log::Progress;
use crate::runtime::podman::{self, PodmanContainer};
use crate::store::{ContainerStore, How};
use std::path::PathBuf;
use sys::Context;

/// A spare: its container's ID and name.
#[derive(Debug, Clone, PartialEq)]
pub struct Spare {
    pub id: String,
    pub name: String,
}

fn dir(store: &ContainerStore, sp: &str) -> PathBuf {
    store.dir.join("spares").join(sp)
}

/// The spares registered for statepoint `sp` (not necessarily still there).
pub fn registered(store: &ContainerStore, sp: &str) -> Vec<Spare> {
    let Ok(entries) = std::fs::read_dir(dir(store, sp)) else { return Vec::new() };
    let mut out: Vec<Spare> = entries
        .flatten()
        .filter_map(|e| {
            let id = e.file_name().to_str()?.to_string();
            let name = std::fs::read_to_string(e.path()).ok()?.trim().to_string();
            Some(Spare { id, name })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn register(store: &ContainerStore, sp: &str, s: &Spare) -> Result<()> {
    let d = dir(store, sp);
    std::fs::create_dir_all(&d).at("create", &d)?;
    Ok(sys::write_atomic(&d.join(&s.id), s.name.as_bytes(), 0o644)?)
}

/// Takes `s` out of the registry (a fork claims it: [`super::fork`]'s jobs); true for exactly one
/// caller (false: another fork took it). Whether it is still a frozen container shows when it is
/// handed out (the thaw and the lookup fail otherwise): a Podman call less on the fork's path.
pub(super) fn unregister(store: &ContainerStore, sp: &str, s: &Spare) -> bool {
    std::fs::remove_file(dir(store, sp).join(&s.id)).is_ok()
}

/// Present in a spare's own store while planarian holds it frozen; names its cgroup.
const FROZEN: &str = "spare-frozen";

fn marker(cfg: &Config, id: &str) -> PathBuf {
    ContainerStore::new(&cfg.store.path, id).dir.join(FROZEN)
}

/// Freezes the running spare `id` and marks it held.
fn freeze(engine: &Engine, id: &str) -> Result<()> {
    let ctx = super::Ctx::load(engine, id)?;
    // (held once its memory is all there and settled: a thaw is then all a fork needs)
    crate::local::lazy::settled(&ctx.store).map_err(crate::local::Error::from)?;
    let freezer = Freezer::of_pid(ctx.ctr.running_pid()?)?;
    let m = marker(engine.config(), id);
    std::fs::write(&m, freezer.dir().display().to_string()).at("write", &m)?;
    Ok(freezer.freeze()?)
}

/// The freezer of spare `id`, if planarian holds it.
fn held(cfg: &Config, id: &str) -> Option<Freezer> {
    let dir = std::fs::read_to_string(marker(cfg, id)).ok()?;
    Some(Freezer::at(PathBuf::from(dir.trim())))
}

/// Thaws spare `id`: it runs.
fn thaw(cfg: &Config, id: &str) -> Result<()> {
    let f = held(cfg, id).ok_or_else(|| Error::Worker("not held frozen by planarian".into()))?;
    f.thaw()?;
    let _ = std::fs::remove_file(marker(cfg, id));
    Ok(())
}

/// Whether spare `s` is still a running container that planarian holds frozen.
fn usable(cfg: &Config, s: &Spare) -> bool {
    held(cfg, &s.id).is_some_and(|f| f.is_frozen()) && podman::inspect(&s.id).is_ok_and(|c| c.status == "running")
}

/// Removes spare `s` (thawed first: a frozen process waits for its thaw even to die, under the
/// cgroup-v1 freezer).
fn remove(cfg: &Config, src: &PodmanContainer, s: &Spare) {
    remove_id(cfg, src, &s.id);
}

/// The spares of one committed statepoint of a planarian container.
pub struct Pool {
    pub(super) source: PodmanContainer,
    pub(super) engine: Engine,
    store: ContainerStore,
    /// The statepoint's ID.
    pub sp: String,
}

/// The pool of statepoint `statepoint` of `container`, or the error that says why there is none
/// (before anything is done).
pub fn pool(engine: &Engine, container: &str, statepoint: &str) -> Result<Pool> {
    let source = super::planarian_container(engine, container)?;
    let store = engine.store(&source.id);
    let sp = super::committed(store.find(statepoint)?)?.statepoint_id;
    Ok(Pool { source, engine: engine.clone(), store, sp })
}

/// How a spare is made: a fork (named, under its record) of the pool's statepoint, by
/// [`super::fork::keep_spares`]; the new container's ID.
pub type MakeSpare<'a> = dyn FnMut(&Pool, &str, &mut Record, &mut dyn Progress) -> Result<String> + 'a;

/// Keeps `count` spares of the pool's statepoint: makes the missing ones (`make`), removes the
/// extra ones and any that is no longer a container planarian holds frozen. Returns them.
pub fn fill(pool: Pool, count: usize, make: &mut MakeSpare, progress: &mut dyn Progress) -> Result<Vec<Spare>> {
    let Pool { source, engine, store, sp } = &pool;
    let cfg = engine.config();
    let mut have = Vec::new();
    for s in registered(store, sp) {
        if usable(cfg, &s) {
            have.push(s);
        } else if unregister(store, sp, &s) {
            remove(cfg, source, &s);
        }
    }
    while have.len() > count {
        let s = have.pop().expect("more than count");
        if unregister(store, sp, &s) {
            progress.phase(&format!("removing spare {}", s.name));
            remove(cfg, source, &s);
        }
    }
    while have.len() < count {
        // (until it is registered: a spare a killed planarian was making is removed)
        let stem = format!("{}-spare-{sp}", source.name);
        let mut record = forking::free_record(store, &stem, sp, Kind::Spare, &|_| false)?;
        let name = record.name().to_string();
        let id = make(&pool, &name, &mut record, progress)?;
        progress.phase(&format!("spare {name}: frozen"));
        let spare = Spare { id, name };
        if let Err(e) = freeze(engine, &spare.id).and_then(|()| register(store, sp, &spare)) {
            remove(cfg, source, &spare);
            return Err(Error::ForkFailed(Box::new(e)));
        }
        drop(record);
        have.push(spare);
    }
    Ok(have)
}

/// Removes every spare of statepoint `sp` of `container` (its statepoint removed).
pub fn remove_all(engine: &Engine, container: &str, sp: &str) -> Result<usize> {
    let source = podman::inspect(container)?;
    let cfg = engine.config();
    let store = engine.store(&source.id);
    let mut n = 0;
    for s in registered(&store, sp) {
        if unregister(&store, sp, &s) {
            remove(cfg, &source, &s);
            n += 1;
        }
    }
    let _ = std::fs::remove_dir(dir(&store, sp));
    Ok(n)
}

/// Puts claimed spare `s` back in the registry (the fork it was claimed for did not start).
pub(super) fn unclaim(store: &ContainerStore, sp: &str, s: &Spare) {
    let _ = register(store, sp, s);
}

/// [`unclaim`] of spare `id`, when it is still a container planarian holds frozen.
pub(super) fn unclaim_id(cfg: &Config, store: &ContainerStore, sp: &str, id: &str) {
    if let Ok(c) = podman::inspect(id) {
        if c.status == "running" && held(cfg, id).is_some_and(|f| f.is_frozen()) {
            unclaim(store, sp, &Spare { id: c.id, name: c.name });
        }
    }
}

/// Hands claimed spare `s` out as `name`: renamed (unless that is its name) and thawed, its
/// restore context saying so. On failure the spare is removed (the caller forks anew).
pub fn hand_out(
    engine: &Engine,
    src: &PodmanContainer,
    s: &Spare,
    name: &str,
) -> Result<(PodmanContainer, RestoreContext)> {
    let out = finish(engine, &s.id, &s.name, name, false);
    if out.is_err() {
        remove(engine.config(), src, s);
    }
    out
}

/// A hand-out a killed planarian left, of spare `new`, finished as `name` (it may have been
/// renamed and thawed already); the spare removed when it cannot be.
pub(super) fn finish_hand_out(engine: &Engine, src: &PodmanContainer, new: &PodmanContainer, name: &str) -> Result<()> {
    finish(engine, &new.id, &new.name, name, true).map(drop).inspect_err(|_| remove_id(engine.config(), src, &new.id))
}

/// Spare `id`, named `now`, renamed `name` (unless so named) and thawed (`recovering`: unless
/// a hand-out already thawed it), its restore context saying so.
fn finish(
    engine: &Engine,
    id: &str,
    now: &str,
    name: &str,
    recovering: bool,
) -> Result<(PodmanContainer, RestoreContext)> {
    let cfg = engine.config();
    if name != now {
        podman::rename(id, name)?;
    }
    if !recovering || held(cfg, id).is_some() {
        thaw(cfg, id)?;
    }
    let new = super::planarian_container(engine, id)?;
    let store = ContainerStore::new(&cfg.store.path, &new.id);
    let mut ctx =
        RestoreContext::last(&store).ok_or_else(|| Error::Worker(format!("spare {now} has no restore context")))?;
    ctx.container = name.to_string();
    ctx.time = crate::log::rfc3339(std::time::SystemTime::now());
    ctx.how = Some(How { path: "spare".into(), ..How::default() });
    ctx.save(&store)?;
    Ok((new, ctx))
}

/// Removes spare `id` (thawed first).
pub(super) fn remove_id(cfg: &Config, src: &PodmanContainer, id: &str) {
    let _ = thaw(cfg, id);
    forking::discard_id(cfg, src, id);
}

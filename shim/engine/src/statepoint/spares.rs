//! Spare forks (FAST-ROLLBACK's direction 3): forks of a statepoint made ahead of time, restored
//! and then paused by Podman, so that a later fork of that statepoint is a rename and an unpause
//! instead of a clone, an init and a CRIU restore.
//!
//! `planarian spare CTR SP --count N` keeps N of them. Each is an ordinary fork (its own
//! container, store, files and database branch), named `CTR-spare-SP-K`, paused with
//! `podman pause` — so `podman ps` shows it, paused, and Podman, conmon and the network stay in
//! charge of it — and registered in CTR's store under `spares/SP/ID`. `planarian fork CTR SP
//! --name NEW` claims a registered spare (removing its registration, so that two forks never get
//! the same one), renames it NEW and unpauses it; when there is none, or the one claimed is
//! unusable, the fork is made as before.
//!
//! A spare runs for the moment between its restore and its pause: a process that acts on the
//! world outside the sandbox the moment it resumes does so then, not when the spare is handed
//! out. Spares are containers of their own: `--count 0` removes a statepoint's spares, and so does
//! `planarian statepoint rm`; removing CTR, or its retention removing the statepoint, leaves them
//! to `podman rm`.

use super::fork::{discard, Fork};
use super::{Error, Result};
use crate::config::Config;
use crate::context::RestoreContext;
use crate::log::Progress;
use crate::runtime::podman::{self, PodmanContainer};
use crate::runtime::Globals;
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

/// Takes `s` out of the registry; true for exactly one caller.
fn unregister(store: &ContainerStore, sp: &str, s: &Spare) -> bool {
    std::fs::remove_file(dir(store, sp).join(&s.id)).is_ok()
}

/// Whether spare `s` is still a paused container.
fn usable(s: &Spare) -> bool {
    podman::inspect(&s.id).is_ok_and(|c| c.status == "paused")
}


/// The spares of one committed statepoint of a planarian container.
pub struct Pool {
    source: PodmanContainer,
    cfg: Config,
    store: ContainerStore,
    /// The statepoint's ID.
    pub sp: String,
    globals: Globals,
}

/// The pool of statepoint `statepoint` of `container`, or the error that says why there is none
/// (before anything is done).
pub fn pool(globals: &Globals, container: &str, statepoint: &str) -> Result<Pool> {
    let source = super::planarian_container(globals, container)?;
    let cfg = Config::load()?;
    let store = ContainerStore::new(&cfg.store.path, &source.id);
    let sp = super::committed(store.find(statepoint)?)?.statepoint_id;
    Ok(Pool { source, cfg, store, sp, globals: globals.clone() })
}

/// Keeps `count` spares of the pool's statepoint: makes the missing ones, removes the extra ones
/// and any that is no longer a paused container. Returns them.
pub fn fill(pool: Pool, count: usize, progress: &mut dyn Progress) -> Result<Vec<Spare>> {
    let Pool { source, cfg, store, sp, globals } = pool;
    let mut have = Vec::new();
    for s in registered(&store, &sp) {
        if usable(&s) {
            have.push(s);
        } else if unregister(&store, &sp, &s) {
            discard(&cfg, &source, &s.id);
        }
    }
    while have.len() > count {
        let s = have.pop().expect("more than count");
        if unregister(&store, &sp, &s) {
            progress.phase(&format!("removing spare {}", s.name));
            discard(&cfg, &source, &s.id);
        }
    }
    while have.len() < count {
        let name = super::fork::free_name(&format!("{}-spare-{sp}", source.name));
        let fork = Fork::begin(&globals, &source.id, &sp, Some(&name))?;
        progress.phase(&format!("spare {name}: {}", fork.title()));
        let (new, _) = fork.make(&name, progress)?;
        progress.phase(&format!("spare {name}: paused (podman pause)"));
        let spare = Spare { id: new.id, name };
        if let Err(e) = podman::run(&["pause", &spare.id]).map_err(Error::from).and_then(|()| register(&store, &sp, &spare)) {
            discard(&cfg, &source, &spare.id);
            return Err(Error::ForkFailed(Box::new(e)));
        }
        have.push(spare);
    }
    Ok(have)
}

/// Removes every spare of statepoint `sp` of `container` (its statepoint removed).
pub fn remove_all(container: &str, sp: &str) -> Result<usize> {
    let source = podman::inspect(container)?;
    let cfg = Config::load()?;
    let store = ContainerStore::new(&cfg.store.path, &source.id);
    let mut n = 0;
    for s in registered(&store, sp) {
        if unregister(&store, sp, &s) {
            discard(&cfg, &source, &s.id);
            n += 1;
        }
    }
    let _ = std::fs::remove_dir(dir(&store, sp));
    Ok(n)
}

/// Claims a registered spare of `sp`; none when there is none. Whether it is still a paused
/// container shows when it is handed out (the rename and the unpause fail otherwise): a Podman
/// call less on the fork's path.
pub fn claim(store: &ContainerStore, sp: &str) -> Option<Spare> {
    // (false: another fork took it)
    registered(store, sp).into_iter().find(|s| unregister(store, sp, s))
}

/// Hands claimed spare `s` out as `name`: renamed (unless that is its name) and unpaused, its
/// restore context saying so. On failure the spare is removed (the caller forks anew).
pub fn hand_out(globals: &Globals, cfg: &Config, src: &PodmanContainer, s: &Spare, name: &str) -> Result<(PodmanContainer, RestoreContext)> {
    let out = (|| {
        // (Both at once measured no faster: Podman's two processes share two CPUs and its locks.)
        if name != s.name {
            podman::run(&["rename", &s.id, name])?;
        }
        podman::run(&["unpause", &s.id])?;
        let new = super::planarian_container(globals, &s.id)?;
        let store = ContainerStore::new(&cfg.store.path, &new.id);
        let mut ctx = RestoreContext::last(&store).ok_or_else(|| Error::Worker(format!("spare {} has no restore context", s.name)))?;
        ctx.container = name.to_string();
        ctx.time = crate::log::rfc3339(std::time::SystemTime::now());
        ctx.how = Some(How { path: "spare".into(), ..How::default() });
        ctx.save(&store)?;
        Ok((new, ctx))
    })();
    if out.is_err() {
        discard(cfg, src, &s.id);
    }
    out
}

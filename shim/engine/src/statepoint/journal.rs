//! A rollback's journal: where a rollback of a running sandbox stands, written down before each
//! step that changes the sandbox, so that a planarian killed in the middle (SIGKILL, the OOM
//! killer, a reboot of the host's session) leaves a sandbox the next operation puts exactly as it
//! was before the rollback or exactly at its target — never stopped, never half-restored.
//!
//! The safety statepoint of the current state is what the way back is made of: its ID is
//! reserved before the rollback starts and written here. What the next operation does, under the
//! container's exclusive lock ([`recover`]):
//!
//! | what it finds | what it does |
//! |---|---|
//! | a compensation under way | finishes it: sandbox and services at the target |
//! | phase `done` | nothing left but cleanup: at the target |
//! | phase `started`, the same processes running | nothing was written: thawed, as before |
//! | phase `restoring-safety`, new processes running | the safety statepoint runs: as before |
//! | anything else (stopped, half-written, the target restored but not compensated) | the sandbox is stopped and the safety statepoint restored, files and processes: as before |
//!
//! The remote state is never left apart from the sandbox: it is compensated only after the
//! target runs, under the compensation's own intent, and `done` is written before that intent
//! is removed.

use super::{Error, Result};
use crate::config::Config;
use crate::local::freezer::{FreezeGuard, MARKER};
use crate::runtime::{self, podman, Container, Globals};
use crate::store::{read_manifest, ContainerStore, Manifest, Status};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;

const JOURNAL: &str = "rolling-back.json";

/// How far a rollback got.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// The sandbox is untouched, or frozen, or stopped with its safety statepoint committed.
    Started,
    /// Files and memory are being written in place (the safety statepoint is committed).
    Writing,
    /// The target's files and processes are being put in place by a restore.
    RestoringTarget,
    /// The rollback failed and the safety statepoint is being restored.
    RestoringSafety,
    /// The sandbox is at the target, its services compensated (or being, under their intent).
    Done,
}

#[derive(Serialize, Deserialize, Debug, Clone)]
struct Entry {
    /// The planarian that writes it.
    pid: u32,
    target: String,
    /// The safety statepoint's reserved ID.
    safety: String,
    /// The head before the rollback.
    from: Option<String>,
    /// The container's init (PID, start time) when the rollback started.
    init: (i32, u64),
    phase: Phase,
}

/// The journal of a rollback under way; removed when dropped (the rollback ended, either way,
/// in this process).
pub struct Journal {
    path: PathBuf,
    entry: Entry,
}

impl Journal {
    /// Written before the rollback changes anything: of the running container whose init is
    /// `init_pid`, to statepoint `target`, with the safety statepoint `safety` (reserved).
    pub fn begin(store: &ContainerStore, target: &str, safety: &str, init_pid: i32) -> Result<Journal> {
        let entry = Entry {
            pid: std::process::id(),
            target: target.to_string(),
            safety: safety.to_string(),
            from: store.head(),
            init: (init_pid, sys::proc::start_time(init_pid).unwrap_or(0)),
            phase: Phase::Started,
        };
        let j = Journal { path: store.dir.join(JOURNAL), entry };
        j.write()?;
        Ok(j)
    }

    /// The rollback reached `phase`; written before the step it names begins.
    pub fn phase(&mut self, phase: Phase) -> Result<()> {
        self.entry.phase = phase;
        self.write()
    }

    fn write(&self) -> Result<()> {
        let text = serde_json::to_vec(&self.entry).expect("a journal serialises");
        Ok(sys::write_atomic(&self.path, &text, 0o600)?)
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether container store `store` holds the journal of an interrupted rollback.
pub fn interrupted(store: &ContainerStore) -> bool {
    interrupted_to(store).is_some()
}

/// The target of the interrupted rollback whose journal `store` holds.
pub fn interrupted_to(store: &ContainerStore) -> Option<String> {
    read(store).filter(|e| e.pid != std::process::id()).map(|e| e.target)
}

fn read(store: &ContainerStore) -> Option<Entry> {
    let text = std::fs::read(store.dir.join(JOURNAL)).ok()?;
    serde_json::from_slice(&text).ok()
}

/// Where an interrupted rollback ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Recovered {
    AtTarget(String),
    /// At the target, its compensation finished now.
    Compensated(String),
    AsBefore(String),
}

/// Finishes or undoes the rollback a killed planarian left (see the module's table), and says
/// which on stderr; a recovery that fails leaves the journal, says why, and is tried again by the
/// next operation. Call with the container's exclusive lock held, before anything else of the
/// recovery (a half-written sandbox must not be thawed first).
pub fn recover(globals: &Globals, cfg: &Config, store: &ContainerStore, id: &str) -> Option<Recovered> {
    let e = read(store).filter(|e| e.pid != std::process::id())?;
    match resolve(globals, cfg, store, id, &e) {
        Ok(r) => {
            let _ = std::fs::remove_file(store.dir.join(JOURNAL));
            match &r {
                Recovered::AtTarget(t) => {
                    eprintln!("planarian: an interrupted rollback to {t} was finished: the sandbox is at {t}")
                }
                Recovered::Compensated(t) => super::said_compensated(t),
                Recovered::AsBefore(t) => eprintln!(
                    "planarian: an interrupted rollback to {t} was undone: the sandbox is as it was before it"
                ),
            }
            Some(r)
        }
        Err(err) => {
            eprintln!(
                "planarian: an interrupted rollback to {} could not be recovered (tried again by the next operation): {err}",
                e.target
            );
            None
        }
    }
}

fn resolve(globals: &Globals, cfg: &Config, store: &ContainerStore, id: &str, e: &Entry) -> Result<Recovered> {
    let marker = store.dir.join(MARKER);
    // A compensation under way: the sandbox was at the target before it began.
    let crun = runtime::crun(cfg)?;
    let init = Container::load(&crun, globals, id)
        .ok()
        .and_then(|c| c.running_pid().ok())
        .and_then(|pid| Some((pid, sys::proc::start_time(pid)?)));
    if crate::remote::hooks::finish_interrupted(&store.dir, id)?.is_some() {
        FreezeGuard::recover(&marker);
        return at_target(cfg, store, e, init).map(|_| Recovered::Compensated(e.target.clone()));
    }
    match decide(e.phase, init, e.init) {
        Action::AtTarget => {
            FreezeGuard::recover(&marker);
            at_target(cfg, store, e, init)
        }
        Action::Thaw => {
            FreezeGuard::recover(&marker);
            forget_safety(cfg, store, e);
            Ok(Recovered::AsBefore(e.target.clone()))
        }
        Action::SafetyRuns => {
            forget_safety(cfg, store, e);
            let _ = store.set_head(e.from.as_deref());
            Ok(Recovered::AsBefore(e.target.clone()))
        }
        Action::BackToSafety => back_to_safety(globals, cfg, store, id, e),
    }
}

/// What the next operation does with an interrupted rollback (no compensation under way).
#[derive(Debug, PartialEq, Eq)]
enum Action {
    /// It ended: at the target.
    AtTarget,
    /// Nothing was written: the same processes, thawed.
    Thaw,
    /// The safety statepoint was restored: as before.
    SafetyRuns,
    /// Anything else: stop what runs, restore the safety statepoint.
    BackToSafety,
}

/// The module's table: from the phase reached, the container's init now (PID, start time; none
/// when it does not run) and its init when the rollback began.
fn decide(phase: Phase, now: Option<(i32, u64)>, then: (i32, u64)) -> Action {
    match (phase, now) {
        (Phase::Done, _) => Action::AtTarget,
        (Phase::Started, Some(n)) if n == then => Action::Thaw,
        (Phase::RestoringSafety, Some(n)) if n != then => Action::SafetyRuns,
        _ => Action::BackToSafety,
    }
}

/// The sandbox is at the target. Its next dump is full: a rollback in place killed before it
/// recorded its base leaves the soft-dirty bits of pages it wrote cleared against another base.
fn at_target(cfg: &Config, store: &ContainerStore, e: &Entry, init: Option<(i32, u64)>) -> Result<Recovered> {
    crate::chain::write_base(
        store,
        &crate::chain::Base {
            images: None,
            depth: 0,
            init_start_time: init.map_or(0, |(_, start)| start),
            full_reason: Some(format!("an interrupted rollback to {} was finished", e.target)),
        },
    )?;
    forget_safety(cfg, store, e);
    store.set_head(Some(&e.target))?;
    if let Ok(m) = store.find(&e.target) {
        crate::context::mark_unreachable(store, &m);
    }
    Ok(Recovered::AtTarget(e.target.clone()))
}

fn committed_safety(store: &ContainerStore, e: &Entry) -> Option<Manifest> {
    read_manifest(&store.statepoint_dir(&e.safety).join("manifest.json")).ok().filter(|m| m.status == Status::Committed)
}

/// The safety statepoint, no longer needed (one left pending is the next operation's to remove).
fn forget_safety(cfg: &Config, store: &ContainerStore, e: &Entry) {
    if committed_safety(store, e).is_some() {
        let _ = super::remove(cfg, store, &e.safety);
    }
    super::discard_stale(cfg, store);
}

/// Stops the sandbox (killed while frozen: nothing half-written runs) and restores the safety
/// statepoint: files, then processes through Podman.
fn back_to_safety(globals: &Globals, cfg: &Config, store: &ContainerStore, id: &str, e: &Entry) -> Result<Recovered> {
    let safety = committed_safety(store, e)
        .ok_or_else(|| Error::Worker(format!("the rollback's safety statepoint {} was never committed", e.safety)))?;
    let pc = podman::planarian_container(id)?;
    // (whatever runs: the statepoint's processes, or ones half-written; killed while frozen)
    let crun = runtime::crun(cfg)?;
    let _ = std::process::Command::new(&crun)
        .args(globals.crun_args())
        .args(["kill", id, "KILL"])
        .stderr(std::process::Stdio::null())
        .status();
    FreezeGuard::recover(&store.dir.join(MARKER));
    podman::wait_stopped(id, pc.upperdir.as_deref(), Duration::from_secs(60))?;
    let rootfs = crate::local::rootfs_for(cfg, store, id, pc.upperdir.clone())?;
    let files = rootfs.restore(&store.statepoint_dir(&e.safety), &safety.local_state)?;
    super::rollback::podman_restore(store, &pc, &safety)?;
    files.commit();
    let _ = super::remove(cfg, store, &e.safety);
    store.set_head(e.from.as_deref())?;
    Ok(Recovered::AsBefore(e.target.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table() {
        let then = (42, 1000);
        let other = Some((57, 2000));
        use Action::*;
        use Phase::*;
        for (phase, now, want) in [
            (Done, None, AtTarget),
            (Done, Some(then), AtTarget),
            (Done, other, AtTarget),
            (Started, Some(then), Thaw),
            // stopped after its safety statepoint, before the restore began
            (Started, None, BackToSafety),
            (Started, other, BackToSafety),
            // half-written in place: the same processes, or killed with planarian
            (Writing, Some(then), BackToSafety),
            (Writing, None, BackToSafety),
            // the target restored, not compensated
            (RestoringTarget, other, BackToSafety),
            (RestoringTarget, None, BackToSafety),
            (RestoringSafety, other, SafetyRuns),
            (RestoringSafety, None, BackToSafety),
            // (a PID reused: another start time is another process)
            (Started, Some((42, 1001)), BackToSafety),
        ] {
            assert_eq!(decide(phase, now, then), want, "{phase:?} {now:?}");
        }
    }

    #[test]
    fn a_journal_is_its_writers_until_it_ends_and_an_interrupted_one_is_found() {
        let dir = std::env::temp_dir().join(format!("planarian-journal-{}", std::process::id()));
        let store = ContainerStore::new(&dir, "c");
        std::fs::create_dir_all(&store.dir).unwrap();
        let me = std::process::id() as i32;
        let mut j = Journal::begin(&store, "sp2", "sp5", me).unwrap();
        assert!(!interrupted(&store), "the writer's own journal is not an interrupted one");
        j.phase(Phase::RestoringTarget).unwrap();
        assert_eq!(read(&store).unwrap().phase, Phase::RestoringTarget);
        assert_eq!(read(&store).unwrap().init.0, me);
        // As a killed writer leaves it.
        let mut e = read(&store).unwrap();
        e.pid = u32::MAX;
        std::mem::forget(j);
        std::fs::write(store.dir.join(JOURNAL), serde_json::to_vec(&e).unwrap()).unwrap();
        assert!(interrupted(&store));
        let j = Journal::begin(&store, "sp3", "sp6", me).unwrap();
        drop(j);
        assert!(read(&store).is_none(), "removed when the rollback ends");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

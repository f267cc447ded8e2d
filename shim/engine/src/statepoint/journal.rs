//! A rollback's journal: where a rollback of a running sandbox stands, written down before each
//! step that changes the sandbox, so that a planarian killed in the middle (SIGKILL, the OOM
//! killer, a reboot of the host's session) leaves a sandbox the next operation puts exactly as it
//! was before the rollback or exactly at its target — never stopped, never half-restored.
//!
//! A rollback that stops and restores takes a safety statepoint of the current state: the way
//! back is made of it, its ID reserved before the rollback starts and written here. A rollback
//! in place takes none: until it compensates the remote state it has changed nothing, and from
//! then on it only goes forward (phase `forward`). What the next operation does, under the
//! container's exclusive lock ([`recover`]):
//!
//! | what it finds | what it does |
//! |---|---|
//! | phase `forward` (a rollback in place past its compensation) | finishes the compensation, stops whatever runs and restores the target: sandbox and services at the target |
//! | a compensation under way | finishes it: sandbox and services at the target |
//! | phase `done` | nothing left but cleanup: at the target |
//! | phase `started`, the same processes running | nothing was written: thawed, as before |
//! | phase `restoring-safety`, new processes running | the safety statepoint runs: as before |
//! | anything else (stopped, half-written, the target restored but not compensated) | the sandbox is stopped and the safety statepoint restored, files and processes: as before |
//!
//! The remote state is never left apart from the sandbox: on the stop-and-restore path it is
//! compensated only after the target runs; in place, before anything is written, and from then
//! on the sandbox only goes to the target. Either way under the compensation's own intent, and
//! `done` is written before that intent is removed.

use super::{Error, Result};
use crate::config::Config;
use crate::local::freezer::{FreezeGuard, MARKER};
use crate::runtime::{self, podman, Container, Globals};
use crate::store::{read_manifest, ContainerStore, Manifest, Status};
use crate::tools::NotFound;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

const JOURNAL: &str = "rolling-back.json";

/// How far a rollback got.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// The sandbox is untouched, or frozen, or stopped with its safety statepoint committed.
    Started,
    /// Files and memory are being written in place (the safety statepoint is committed). A
    /// journal of an earlier planarian may say so; this one says [`Phase::Forward`].
    Writing,
    /// A rollback in place compensates the remote state, then writes files and memory: there
    /// is no way back, only to the target (in place, or by a restore). Kept until `done`.
    Forward,
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

    /// The rollback reached `phase`; written before the step it names begins. (Past
    /// [`Phase::Forward`] only `done` is written: a restore of the target on the way is still
    /// the way forward.)
    pub fn phase(&mut self, phase: Phase) -> Result<()> {
        if self.entry.phase == Phase::Forward && phase != Phase::Done {
            return Ok(());
        }
        self.entry.phase = phase;
        self.write()
    }

    /// A rollback in place put back the pages it wrote ahead of its files' comparison (see
    /// [`crate::local::inplace::ahead`]), before compensating anything: nothing is written, and
    /// the rollback may go another way (`started` again).
    pub fn nothing_written(&mut self) -> Result<()> {
        if self.entry.phase != Phase::Forward {
            return Ok(());
        }
        self.entry.phase = Phase::Started;
        self.write()
    }

    /// The sandbox is at the target and its services compensated: `done`, written before the
    /// compensation's intent is removed. Past the compensation nothing may fail the rollback: a
    /// journal that cannot say so is removed instead (a kill from here on then finds nothing to
    /// undo, and there is nothing to).
    pub fn done(&mut self) {
        if self.phase(Phase::Done).is_err() {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// Left for the next operation: the rollback could not be undone here (its safety
    /// statepoint stays too), and the next operation tries again.
    pub fn keep(self) {
        std::mem::forget(self);
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
    /// Stopped, its state not kept: CRIU killed the processes at the end of a safety dump that
    /// was never committed (established TCP connections, a paused container).
    Stopped(String),
}

/// Finishes or undoes the rollback a killed planarian left (see the module's table), and says
/// which on stderr: `Ok(None)` when there was none. A recovery that fails leaves the journal and
/// is an error: the operation that asked must not go on (it would build on a sandbox half
/// rolled back); the next one tries again. Call with the container's exclusive lock held, before
/// anything else of the recovery (a half-written sandbox must not be thawed first), and never
/// from a verb Podman runs (recovery calls Podman). `crun`: as the caller found it (the
/// Engine's, or the operation's), needed only when there is a journal.
pub fn recover(
    crun: std::result::Result<&Path, NotFound>,
    globals: &Globals,
    cfg: &Config,
    store: &ContainerStore,
    id: &str,
) -> Result<Option<Recovered>> {
    let Some(e) = read(store).filter(|e| e.pid != std::process::id()) else { return Ok(None) };
    // (the stop and restore it may make are a rollback's: the agent's MCP sidecar stays up)
    let _rolling = crate::remote::sidecar::RollbackMarker::set(store);
    wait_for_orphans(store, id, Duration::from_secs(300));
    crate::local::zfs::remove_killed_in_place(cfg, store);
    let r = resolve(crun, globals, cfg, store, id, &e).map_err(|err| {
        Error::Worker(format!(
            "an interrupted rollback to {} could not be finished or undone (tried again by the next operation, or `planarian fsck --repair`): {err}",
            e.target
        ))
    })?;
    let _ = std::fs::remove_file(store.dir.join(JOURNAL));
    match &r {
        Recovered::AtTarget(t) => eprintln!("planarian: an interrupted rollback to {t} was finished: the sandbox is at {t}"),
        Recovered::Compensated(t) => super::said_compensated(t),
        Recovered::AsBefore(t) => {
            eprintln!("planarian: an interrupted rollback to {t} was undone: the sandbox is as it was before it")
        }
        Recovered::Stopped(t) => eprintln!(
            "planarian: an interrupted rollback to {t} left the sandbox stopped and its state was not kept (its statepoints are all there)"
        ),
    }
    Ok(Some(r))
}

/// Waits (at most `max`) until what the killed planarian started against this container has
/// ended — a CRIU with a file of the store open, a `podman container restore` or `kill` naming
/// the container — under a hand-over of the lock, so that a restore it left (whose runtime verb
/// waits for the lock or a hand-over) can end. Deciding before they end would race them: a
/// dump that kills the processes when it ends, a restore that starts the target.
fn wait_for_orphans(store: &ContainerStore, id: &str, max: Duration) {
    let _handoff = super::podman_dir::Handoff::give(store, id);
    let end = std::time::Instant::now() + max;
    let restore_or_kill = |args: &[&[u8]]| {
        args.contains(&id.as_bytes()) && (args.contains(&&b"restore"[..]) || args.contains(&&b"kill"[..]))
    };
    while orphans(std::slice::from_ref(&store.dir), &restore_or_kill) && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether a process other than this one is a CRIU with a file under one of `stores` open, or a
/// Podman whose arguments `podman` matches: what a killed planarian started and left running.
pub(super) fn orphans(stores: &[PathBuf], podman: &dyn Fn(&[&[u8]]) -> bool) -> bool {
    let me = sys::proc::Proc::own();
    let Ok(pids) = sys::proc::processes() else { return false };
    pids.into_iter().filter(|&pid| pid != me.pid()).any(|pid| {
        let p = sys::proc::Proc::of(pid);
        match p.read("comm").unwrap_or_default().trim() {
            "criu" => p.fds().is_ok_and(|fds| {
                fds.into_iter()
                    .any(|fd| p.link(&format!("fd/{fd}")).is_ok_and(|l| stores.iter().any(|s| l.starts_with(s))))
            }),
            "podman" => {
                let cmd = p.read_bytes("cmdline").unwrap_or_default();
                let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
                podman(&args)
            }
            _ => false,
        }
    })
}

fn resolve(
    crun: std::result::Result<&Path, NotFound>,
    globals: &Globals,
    cfg: &Config,
    store: &ContainerStore,
    id: &str,
    e: &Entry,
) -> Result<Recovered> {
    let marker = store.dir.join(MARKER);
    // A compensation under way: the sandbox was at the target before it began.
    let crun = runtime::crun::Crun { bin: crun?, globals };
    let init = Container::load(crun.bin, crun.globals, id)
        .ok()
        .and_then(|c| c.running_pid().ok())
        .and_then(|pid| Some((pid, sys::proc::start_time(pid)?)));
    // (past a rollback in place's compensation: forward, the half-written tree killed first)
    if e.phase == Phase::Forward {
        return forward(&crun, cfg, store, id, e);
    }
    if crate::remote::hooks::finish_interrupted(&store.dir, id)?.is_some() {
        FreezeGuard::recover(&marker);
        return at_target(cfg, store, e, init).map(|_| Recovered::Compensated(e.target.clone()));
    }
    let safety_runs = store.head().as_deref() == Some(e.safety.as_str());
    match decide(e.phase, init, e.init, safety_runs) {
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
        Action::BackToSafety => back_to_safety(&crun, cfg, store, id, e),
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

/// The module's table (but `forward`, which [`resolve`] takes first): from the phase reached, the container's init now (PID, start time; none
/// when it does not run), its init when the rollback began, and whether the head is the safety
/// statepoint (a restore of it sets it when it ends).
fn decide(phase: Phase, now: Option<(i32, u64)>, then: (i32, u64), head_is_safety: bool) -> Action {
    match (phase, now) {
        (Phase::Done, _) => Action::AtTarget,
        (Phase::Started, Some(n)) if n == then => Action::Thaw,
        (Phase::RestoringSafety, Some(n)) if n != then && head_is_safety => Action::SafetyRuns,
        _ => Action::BackToSafety,
    }
}

/// The sandbox is at the target. Its next dump is full: a rollback in place killed before it
/// recorded its base leaves the soft-dirty bits of pages it wrote cleared against another base.
fn at_target(cfg: &Config, store: &ContainerStore, e: &Entry, init: Option<(i32, u64)>) -> Result<Recovered> {
    let why = format!("an interrupted rollback to {} was finished", e.target);
    crate::chain::write_base(store, &crate::chain::Base::full(init.map_or(0, |(_, start)| start), why))?;
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

/// A rollback in place past its compensation: whatever runs (the same processes, frozen, perhaps
/// half-written) is killed while frozen first, before anything that can fail; then the target is
/// restored, files then processes through Podman, and the services compensated to it — a
/// compensation a killed planarian left under way finished, else made (again, when it was done
/// already: a finished compensation is nothing; a planarian killed before it began made none).
fn forward(crun: &runtime::crun::Crun, cfg: &Config, store: &ContainerStore, id: &str, e: &Entry) -> Result<Recovered> {
    crun.kill(id, true);
    FreezeGuard::recover(&store.dir.join(MARKER));
    let pc = podman::planarian_container(id)?;
    let target = store.find(&e.target)?;
    restore_killed(crun, cfg, store, &pc, &target)?;
    let finished = crate::remote::hooks::finish_interrupted(&store.dir, id)?.is_some();
    if !finished && !target.remote_state.is_empty() {
        let intent = crate::remote::hooks::Intent::write(&store.dir, &e.target, &target.remote_state)?;
        crate::remote::hooks::compensate(&target.remote_state, id)?;
        drop(intent);
    }
    store.set_head(Some(&e.target))?;
    crate::context::mark_unreachable(store, &target);
    forget_safety(cfg, store, e);
    Ok(match finished {
        true => Recovered::Compensated(e.target.clone()),
        false => Recovered::AtTarget(e.target.clone()),
    })
}

/// Whatever runs of container `pc` killed while frozen (nothing half-written runs), and
/// statepoint `m` restored: files, then processes through Podman.
fn restore_killed(
    crun: &runtime::crun::Crun,
    cfg: &Config,
    store: &ContainerStore,
    pc: &podman::PodmanContainer,
    m: &Manifest,
) -> Result<()> {
    crun.kill(&pc.id, true);
    FreezeGuard::recover(&store.dir.join(MARKER));
    podman::wait_stopped(&pc.id, pc.upperdir.as_deref(), Duration::from_secs(60))?;
    let rootfs = crate::local::rootfs_for(cfg, store, &pc.id, pc.upperdir.clone())?;
    let files = rootfs.restore(&store.statepoint_dir(&m.statepoint_id), &m.local_state)?;
    super::podman_dir::podman_restore(store, pc, m)?;
    files.commit();
    Ok(())
}

/// Stops the sandbox (killed while frozen: nothing half-written runs) and restores the safety
/// statepoint: files, then processes through Podman.
fn back_to_safety(
    crun: &runtime::crun::Crun,
    cfg: &Config,
    store: &ContainerStore,
    id: &str,
    e: &Entry,
) -> Result<Recovered> {
    let pc = podman::planarian_container(id)?;
    let Some(safety) = committed_safety(store, e) else {
        // Never committed: the processes still run as they were (frozen: thawed), or a dump that
        // kills them at its end (established TCP connections, a paused container) stopped them.
        if matches!(pc.status.as_str(), "running" | "paused") {
            FreezeGuard::recover(&store.dir.join(MARKER));
            forget_safety(cfg, store, e);
            return Ok(Recovered::AsBefore(e.target.clone()));
        }
        forget_safety(cfg, store, e);
        return Ok(Recovered::Stopped(e.target.clone()));
    };
    // (whatever runs: the statepoint's processes, or ones half-written; killed while frozen)
    restore_killed(crun, cfg, store, &pc, &safety)?;
    // (the head first: a kill between the two leaves a head that names no statepoint, which
    // fsck clears, rather than a journal whose safety statepoint is gone)
    store.set_head(e.from.as_deref())?;
    let _ = super::remove(cfg, store, &e.safety);
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
        for (phase, now, head_is_safety, want) in [
            (Done, None, false, AtTarget),
            (Done, Some(then), false, AtTarget),
            (Done, other, false, AtTarget),
            (Started, Some(then), false, Thaw),
            // stopped after its safety statepoint, before the restore began
            (Started, None, false, BackToSafety),
            (Started, other, false, BackToSafety),
            // half-written in place: the same processes, or killed with planarian
            (Writing, Some(then), false, BackToSafety),
            (Writing, None, false, BackToSafety),
            // the target restored, not compensated
            (RestoringTarget, other, false, BackToSafety),
            (RestoringTarget, None, false, BackToSafety),
            (RestoringSafety, other, true, SafetyRuns),
            (RestoringSafety, None, true, BackToSafety),
            // new processes, but not the safety statepoint's (started by hand on half-put-back
            // files)
            (RestoringSafety, other, false, BackToSafety),
            // (a PID reused: another start time is another process)
            (Started, Some((42, 1001)), false, BackToSafety),
        ] {
            assert_eq!(decide(phase, now, then, head_is_safety), want, "{phase:?} {now:?} {head_is_safety}");
        }
    }

    #[test]
    fn a_journal_is_its_writers_until_it_ends_and_an_interrupted_one_is_found() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join("journal");
        let store = ContainerStore::new(&dir, "c");
        std::fs::create_dir_all(&store.dir).unwrap();
        let me = std::process::id() as i32;
        let mut j = Journal::begin(&store, "sp2", "sp5", me).unwrap();
        assert!(!interrupted(&store), "the writer's own journal is not an interrupted one");
        j.phase(Phase::RestoringTarget).unwrap();
        assert_eq!(read(&store).unwrap().phase, Phase::RestoringTarget);
        // Forward stays forward through the restore of the target, until done.
        j.phase(Phase::Forward).unwrap();
        j.phase(Phase::RestoringTarget).unwrap();
        assert_eq!(read(&store).unwrap().phase, Phase::Forward);
        j.phase(Phase::Done).unwrap();
        assert_eq!(read(&store).unwrap().phase, Phase::Done);
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
    }
}
